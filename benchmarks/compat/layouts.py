"""The layouts of the compatibility matrix: name -> (world size, ParallelConfig fields)."""
from __future__ import annotations

# Every model type runs these (the ones its plans allow; the others must be refused with a ConfigError).
MATRIX = {
    "dp2": (2, {"dp_shard": 2}),
    "tp2": (2, {"tp": 2}),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),
    "dp2_tp2_sp": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2}),
    "pp2_tp2": (4, {"pp": 2, "tp": 2}),
    "pp2_dp2": (4, {"pp": 2, "dp_shard": 2}),
    "cp2_ring": (2, {"cp": 2, "cp_method": "ring"}),
    "cp2_ulysses": (2, {"cp": 2, "cp_method": "ulysses"}),
    "cp2_tp2_sp": (4, {"cp": 2, "cp_method": "ulysses", "tp": 2, "sequence_parallel": True}),
    # the chunked loss (24 of a micro-batch's 64 tokens at a time): plain, vocabulary-parallel under TP + SP, on a
    # pipeline's last stage
    "dp2_chunked": (2, {"dp_shard": 2, "chunked_loss": 24}),
    "dp2_tp2_sp_chunked": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "chunked_loss": 24}),
    "pp2_chunked": (2, {"pp": 2, "chunked_loss": 24}),
    # the shards, gradients and optimizer states in host memory; what each layer saves for its backward there
    "dp2_offload": (2, {"dp_shard": 2, "cpu_offload": True}),
    "dp2_act_offload": (2, {"dp_shard": 2, "activation_offload": True}),
}

# A few representative architectures run every pipeline schedule with TP, TP + SP and ZeRO-3.
SCHEDULE_EXTRA = {"gpipe": {}, "1f1b": {}, "interleaved_1f1b": {"pp_virtual_stages": 2},
                  "zero_bubble": {"pp_virtual_stages": 2}, "zbv": {}, "dualpipev": {}}
SCHEDULES = {}
for _name, _extra in SCHEDULE_EXTRA.items():
    SCHEDULES[f"pp2_{_name}_tp2"] = (4, {"pp": 2, "tp": 2, "pp_schedule": _name, **_extra})
    SCHEDULES[f"pp2_{_name}_tp2_sp"] = (4, {"pp": 2, "tp": 2, "sequence_parallel": True, "pp_schedule": _name,
                                            **_extra})
    SCHEDULES[f"pp2_{_name}_zero3"] = (4, {"pp": 2, "dp_shard": 2, "pp_schedule": _name, **_extra})
SCHEDULE_TYPES = ("llama", "qwen3", "gemma2", "mixtral")

# Mixture-of-experts types (configs with output_router_logits) also run with the router auxiliary loss on:
# the "model" entry is applied to the tiny config, on both sides of the comparison.
AUX = {"dp2_aux": (2, {"dp_shard": 2, "model": {"output_router_logits": True}}),
       "dp2_tp2_sp_aux": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True,
                              "model": {"output_router_logits": True}}),
       "cp2_aux": (2, {"cp": 2, "model": {"output_router_logits": True}})}

# LoRA (PEFT) on every linear layer of the decoder (rank 4, no dropout; the "peft" entry wraps the tiny model on
# both sides of the comparison): adapters sharded like their base layers under TP + SP and ZeRO-3, and split into
# pipeline stages.
# The adapters' gradients start small (LoRA's B is zero), so these cells clip at 1e-4 to keep clipping active at
# every step.
LORA = {"lora_dp2_tp2_sp": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "peft": {"r": 4}, "clip": 1e-4}),
        "lora_pp2": (2, {"pp": 2, "peft": {"r": 4}, "clip": 1e-4})}

# Expert parallelism, for the types whose experts transformers' expert-parallel plan names: ep borrows its ranks
# from dp_shard x tp (efsdp = what is left), composed with ZeRO-3, TP + SP and a pipeline.
EP = {"ep2": (2, {"dp_shard": 2, "ep": 2}),
      "ep2_dp2": (4, {"dp_shard": 4, "ep": 2}),
      "ep2_tp2_sp": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "ep": 2}),
      "pp2_ep2": (4, {"pp": 2, "dp_shard": 2, "ep": 2}),
      "ep4": (4, {"dp_shard": 4, "ep": 4})}

# ... and with the router auxiliary loss on: its statistics over every rank's tokens, ep ranks included
EP_AUX = {"ep2_aux": (2, {"dp_shard": 2, "ep": 2, "model": {"output_router_logits": True}}),
          "ep2_tp2_sp_aux": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "ep": 2,
                                 "model": {"output_router_logits": True}})}

ALL = {**MATRIX, **SCHEDULES, **AUX, **LORA, **EP, **EP_AUX}


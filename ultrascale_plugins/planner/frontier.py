"""The cost model against the ORNL Frontier study: GPT-style models of 22B, 175B and 1T parameters trained with
Megatron-DeepSpeed on AMD MI250X (S. Dash et al., *Optimizing Distributed Training on Frontier for Large Language
Models*, ISC 2024, arXiv:2312.12705), whose abstract gives 38.38 %, 36.14 % and 31.96 % of the GPU's peak.

The layouts are the authors' published launch scripts (``sajal-vt/Megatron-DeepSpeed-ORNL``, branch FA2:
``launch_gpt22b_bf16.slurm``, ``launch_gpt175b_bf16.slurm``, ``launch_gpt1T_bf16.slurm``): full activation
checkpointing, flash attention 2, micro-batch 1, 1F1B (DeepSpeed's pipeline engine), no sequence parallel, and
DeepSpeed's ZeRO-1 (each script's DeepSpeed config sets ``"zero_optimization": {"stage": 1}`` with fp16; the 22B
script's ``--zero-stage 0`` is a Megatron argument that only chooses how optimizer statistics are reduced).
The models are Megatron's GPT (learned positions, a GeLU MLP of width 4h, the GPT-2 vocabulary padded to a multiple
of 128 x tp), built here as transformers' ``gpt2``.

They are costed with the ``megatron_deepspeed`` memory profile, the system that ran them: 16-bit weights and
gradients whole on every data-parallel rank, the fp32 master weights and Adam's moments partitioned by ZeRO-1, the
step's fp32 gradient partition (``dims/data_parallel/costs.py``); each decoder layer's input kept by the
checkpointing, the stage's output and the attention mask kept by the pipeline engine for every micro-batch in
flight, the embedding dropout's mask on the first stage (``dims/pipeline/costs.py``). Every run fitted its 64 GB
die; so must the prediction.

What the published percentage measures: Megatron-DeepSpeed's throughput calculator (``megatron/utils.py``) counts
24·c·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs per step with c = 4 when activations are checkpointed (the recomputed
forward counted as work), 3 otherwise — every one of these runs checkpoints. That is hardware FLOPs utilization,
not model FLOPs utilization (Korthikanti et al. 2022 define both), so it is compared with the planner's ``hfu``
(the MFU with the recomputed forward counted: 4/3 of it here). Target: within 8 points (issue 25).
"""
from __future__ import annotations

from .cost import CostModel, Layout, Workload
from .hardware import PRESETS
from .model_spec import ModelSpec, load_model_config

TARGET_POINTS = 8.0
PROFILE = "megatron_deepspeed"


def _gpt(layers: int, hidden: int, heads: int, seq_len: int, vocab: int) -> dict:
    return dict(model_type="gpt2", n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq_len,
                vocab_size=vocab, tie_word_embeddings=True)


# name: (model config, sequence length, global batch, layout, published % of peak)
RUNS = {
    "22B": (_gpt(48, 6144, 48, 2048, 50304), 2048, 640,
            Layout(dp_replicate=2, dp_shard=1, tp=1, pp=8, zero_stage=1, micro_batch_size=1, grad_accum=320,
                   activation_checkpointing="full", mixed_precision="bf16"), 38.38),
    "175B": (_gpt(96, 12288, 96, 4096, 50688), 4096, 640,
             Layout(dp_replicate=2, dp_shard=1, tp=4, pp=16, zero_stage=1, micro_batch_size=1, grad_accum=320,
                    activation_checkpointing="full", sequence_parallel=False, mixed_precision="bf16"), 36.14),
    "1T": (_gpt(128, 25600, 200, 2048, 50688), 2048, 1024,
           Layout(dp_replicate=2, dp_shard=1, tp=4, pp=128, zero_stage=1, micro_batch_size=1, grad_accum=512,
                  activation_checkpointing="full", sequence_parallel=False, mixed_precision="bf16"), 31.96),
}


def validate(constants: dict | None = None) -> dict:
    """Predicted MFU and HFU (%) of each published run on the ``mi250x-gcd-64gb`` preset, beside the published
    figure, and the largest gap in points; the predicted peak memory of its most loaded die (GB) and whether it
    fits, as every run did."""
    out = {}
    hardware = PRESETS["mi250x-gcd-64gb"]
    for name, (fields, seq_len, batch, layout, published) in RUNS.items():
        spec = ModelSpec.of(load_model_config(fields))
        model = CostModel(spec, hardware, Workload(seq_len, batch, PROFILE, "adamw"), constants)
        result = model.evaluate(layout)
        out[name] = {"gpus": layout.world, "layout": layout.label(), "params_b": round(spec.total_params / 1e9, 1),
                     "published_pct": published, "predicted_hfu_pct": round(100 * result.hfu, 2),
                     "predicted_mfu_pct": round(100 * result.mfu, 2),
                     "gap_points": round(100 * result.hfu - published, 2), "dominant": result.dominant,
                     "predicted_gb": round(result.memory_gb["total"], 1),
                     "memory_gb": {k: round(v, 2) for k, v in result.memory_gb.items() if k != "total"},
                     "bytes_per_param": round(result.bytes_per_param, 2), "fits": result.fits}
    worst = max(abs(run["gap_points"]) for run in out.values())
    return {"runs": out, "profile": PROFILE, "gpu_memory_gb": hardware.memory_gb, "largest_gap_points": worst,
            "target_points": TARGET_POINTS, "met": worst <= TARGET_POINTS,
            "all_fit": all(run["fits"] for run in out.values())}

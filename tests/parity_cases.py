"""Every layout proven against one process: name -> (world size, architecture, ParallelConfig fields)."""

CASES = {
    # 2 ranks
    "zero3_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "zero_stage": 3}, "roundtrip": True},
    # gradient accumulation ("accumulate": (dp, micro-batches): no_sync before the last, token-weighted): ZeRO-2
    # keeps the weights gathered over the step; grad_sync: step reduces once, after the last micro-batch
    # (the c10d all-gathers and reduce-scatters of the last step are counted: tests/test_parity.py)
    "zero2_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "zero_stage": 2}, "accumulate": (2, 4),
                  "count_collectives": True},
    "zero3_dp2_step_sync": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "grad_sync": "step"},
                            "accumulate": (2, 4), "count_collectives": True},
    # explicit FSDP2 prefetch: the targets each layer was given are counted (tests/test_parity.py)
    "zero3_dp2_prefetch": {"world": 2, "arch": "llama8",
                           "layout": {"dp_shard": 2, "fsdp_forward_prefetch": 2, "fsdp_backward_prefetch": 1}},
    "zero1_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "zero_stage": 1}},
    "ddp_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "zero_stage": 0}},
    "tp2": {"world": 2, "arch": "llama", "layout": {"tp": 2}},
    "tp2_sp": {"world": 2, "arch": "llama", "layout": {"tp": 2, "sequence_parallel": True}},
    "tp2_sp_loss_parallel": {"world": 2, "arch": "llama",
                             "layout": {"tp": 2, "sequence_parallel": True, "loss_parallel": True}},
    "tied_zero3_dp2": {"world": 2, "arch": "llama_tied", "layout": {"dp_shard": 2}},
    "tied_tp2": {"world": 2, "arch": "llama_tied", "layout": {"tp": 2}},
    "tied_tp2_sp": {"world": 2, "arch": "llama_tied", "layout": {"tp": 2, "sequence_parallel": True}},
    "gpt2_zero3_dp2": {"world": 2, "arch": "gpt2", "layout": {"dp_shard": 2}},
    "gpt2_tp2": {"world": 2, "arch": "gpt2", "layout": {"tp": 2}},
    "gpt2_tp2_sp": {"world": 2, "arch": "gpt2", "layout": {"tp": 2, "sequence_parallel": True}},
    "qwen2_tp2": {"world": 2, "arch": "qwen2", "layout": {"tp": 2}},
    "mistral_tp2_sp": {"world": 2, "arch": "mistral", "layout": {"tp": 2, "sequence_parallel": True}},
    "ac_full_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "activation_checkpointing": "full"}},
    "ac_selective_tp2": {"world": 2, "arch": "llama",
                         "layout": {"tp": 2, "activation_checkpointing": "selective"}},
    # bf16 mixed precision (FSDP2 MixedPrecisionPolicy; autocast under TP): compared with the fp32 run at a
    # bf16 tolerance
    "bf16_zero3_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "mixed_precision": "bf16"},
                       "tol": 2e-2},
    "bf16_tp2": {"world": 2, "arch": "llama", "layout": {"tp": 2, "mixed_precision": "bf16"}, "tol": 2e-2},
    # 4 ranks
    "zero3_dp4": {"world": 4, "arch": "llama", "layout": {"dp_shard": 4}},
    "hsdp_2x2": {"world": 4, "arch": "llama", "layout": {"dp_replicate": 2, "dp_shard": 2}},
    "dp2_tp2": {"world": 4, "arch": "llama", "layout": {"dp_shard": 2, "tp": 2}},
    "dp2_tp2_sp": {"world": 4, "arch": "llama", "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True}},
    "zero2_dp2_tp2": {"world": 4, "arch": "qwen2", "layout": {"dp_shard": 2, "tp": 2, "zero_stage": 2}},
    # the seeds' layouts: DDP and ZeRO-1 over tensor parallel, accumulating
    "ddp_dp2_tp2": {"world": 4, "arch": "llama", "layout": {"dp_shard": 2, "tp": 2, "zero_stage": 0},
                    "accumulate": (2, 2)},
    "zero1_dp2_tp2_sp": {"world": 4, "arch": "llama_tied",
                         "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 1},
                         "accumulate": (2, 2), "roundtrip": True},
    "tied_dp2_tp2_sp": {"world": 4, "arch": "llama_tied",
                        "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True}, "roundtrip": True},
    "gpt2_dp2_tp2_sp": {"world": 4, "arch": "gpt2", "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True}},

}

# Pipeline parallel: every schedule at pp=2 and pp=4, for Llama and a tied-embedding Llama, and its compositions.
PP_SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved_1f1b": {"pp_virtual_stages": 2},
                "zero_bubble": {"pp_virtual_stages": 2}, "zbv": {}, "dualpipev": {}}
for _schedule, _extra in PP_SCHEDULES.items():
    for _arch in ("llama8", "llama8_tied"):
        CASES[f"pp2_{_schedule}_{_arch}"] = {"world": 2, "arch": _arch,
                                             "layout": {"pp": 2, "pp_schedule": _schedule, **_extra}}
    CASES[f"pp4_{_schedule}_llama8_tied"] = {"world": 4, "arch": "llama8_tied",
                                             "layout": {"pp": 4, "pp_schedule": _schedule, **_extra}}
CASES.update({
    "pp4_1f1b_llama8": {"world": 4, "arch": "llama8", "layout": {"pp": 4, "pp_schedule": "1f1b"}},
    "pp2_zero3_dp2": {"world": 4, "arch": "llama8_tied", "layout": {"pp": 2, "dp_shard": 2}, "roundtrip": True,
                      "count_collectives": True},
    # grad_sync: micro_batch inside a pipeline: FSDP2 reduce-scatters after every micro-batch's backward (the
    # stages would defer it to the step's last), ZeRO-2 keeping the weights gathered, ZeRO-3 resharding them
    "pp2_zero2_dp2_interleaved": {"world": 4, "arch": "llama8",
                                  "layout": {"pp": 2, "dp_shard": 2, "zero_stage": 2, "grad_sync": "micro_batch",
                                             "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}},
    "pp2_gpipe_zero3_dp2_micro_batch": {"world": 4, "arch": "llama8_tied",
                                        "layout": {"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe",
                                                   "grad_sync": "micro_batch"}, "count_collectives": True},
    "pp2_zbv_dp2_ac_full": {"world": 4, "arch": "llama8_tied",
                            "layout": {"pp": 2, "dp_shard": 2, "pp_schedule": "zbv",
                                       "activation_checkpointing": "full"}},
    "pp2_1f1b_position_ids": {"world": 2, "arch": "llama8_tied", "layout": {"pp": 2}, "positions": True},
    "tp2_sp_position_ids": {"world": 2, "arch": "llama", "layout": {"tp": 2, "sequence_parallel": True},
                            "positions": True},
    "pp2_zero1_dp2": {"world": 4, "arch": "llama8_tied", "layout": {"pp": 2, "dp_shard": 2, "zero_stage": 1}},
    "pp2_ddp_dp2_gpt_neox": {"world": 4, "arch": "gpt_neox",
                             "layout": {"pp": 2, "dp_shard": 2, "zero_stage": 0, "pp_schedule": "gpipe"}},
    "pp2_tp2": {"world": 4, "arch": "llama8_tied", "layout": {"pp": 2, "tp": 2}},
    # the vocabulary-parallel loss on the last stage, inside the schedule (its backward too)
    "pp2_tp2_sp_loss_parallel": {"world": 4, "arch": "llama8",
                                 "layout": {"pp": 2, "tp": 2, "sequence_parallel": True, "loss_parallel": True}},
    "pp2_tp2_sp_interleaved": {"world": 4, "arch": "llama8_tied",
                               "layout": {"pp": 2, "tp": 2, "sequence_parallel": True,
                                          "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}},
    "pp2_tp2_dp2_sp": {"world": 8, "arch": "llama8_tied",
                       "layout": {"pp": 2, "tp": 2, "dp_shard": 2, "sequence_parallel": True}},
    # Frontier's layout (tp x pp x dp at ZeRO-1), small: FSDP2 over the tensor-parallel stages, gathered for the step
    "pp2_tp2_dp2_zero1": {"world": 8, "arch": "llama8_tied", "layout": {"pp": 2, "tp": 2, "dp_shard": 2,
                                                                        "zero_stage": 1}},
    "pp2_tp2_dp2_zbv": {"world": 8, "arch": "llama8", "layout": {"pp": 2, "tp": 2, "dp_shard": 2,
                                                                 "pp_schedule": "zbv"}},
})

# Layouts with the out-of-package plugin's axis (tests/outside_plugin: ``acme_dp`` splits each replica's rows,
# averages gradients, counts tokens). Run by tests/test_outside_plugin.py with the plugin on PYTHONPATH.
OUTSIDE_CASES = {
    "acme2_zero3_dp2": {"world": 4, "arch": "llama", "layout": {"acme_dp": 2, "dp_shard": 2}, "roundtrip": True},
    "acme2_tp2_sp": {"world": 4, "arch": "llama", "layout": {"acme_dp": 2, "tp": 2, "sequence_parallel": True,
                                                             "acme_fused_norm": True}},
    "acme2_pp2": {"world": 4, "arch": "llama8_tied", "layout": {"acme_dp": 2, "pp": 2, "pp_microbatches": 2}},
}

# Context parallel (sequence of 256 tokens, so each rank's chunks hold several documents and the padding): ring
# and Ulysses at cp=2 and cp=4, on right-padded and on packed batches (documents separated by restarting
# position_ids, no mask), and composed with ZeRO-3, TP + SP, pipeline, and in 3-D.
for _method in ("ring", "ulysses"):
    for _cp in (2, 4):
        for _data in ("padded", "packed"):
            CASES[f"cp{_cp}_{_method}_{_data}"] = {"world": _cp, "arch": "llama", "seq": 256, "data": _data,
                                                   "layout": {"cp": _cp, "cp_method": _method}}
# compositions: each with both methods, on padded and packed batches (see below for 8 ranks)
CP_COMPOSITIONS = {
    "cp2_dp2": (4, "llama", {"cp": 2, "dp_shard": 2}),
    "cp2_tp2_sp": (4, "llama", {"cp": 2, "tp": 2, "sequence_parallel": True}),
    "cp2_pp2": (4, "llama8_tied", {"cp": 2, "pp": 2}),
    "dp2_cp2_tp2": (8, "llama", {"dp_shard": 2, "cp": 2, "tp": 2, "sequence_parallel": True}),
    "cp2_tp2_pp2": (8, "llama8_tied", {"cp": 2, "tp": 2, "pp": 2}),
}
# on 8 ranks (16 processes' worth of gloo traffic timeshared on CI's 2 cores) each method runs once, ring on packed and
# Ulysses on padded rows: every method x data pair already runs in each 4-rank composition
for _name, (_world, _arch, _layout) in CP_COMPOSITIONS.items():
    for _method in ("ring", "ulysses"):
        for _data in ("padded", "packed"):
            if _world == 8 and (_method, _data) not in (("ring", "packed"), ("ulysses", "padded")):
                continue
            CASES[f"{_name}_{_method}_{_data}"] = {"world": _world, "arch": _arch, "seq": 256, "data": _data,
                                                   "layout": {**_layout, "cp_method": _method}}
# the portable ring (matmul + softmax in fp32) chosen by the layout instead of the SDPA kernels
CASES["cp2_ring_portable_packed"] = {"world": 2, "arch": "llama", "seq": 256, "data": "packed",
                                     "layout": {"cp": 2, "cp_kernel": "portable"}}
# packed documents inside pipeline stages (the stages pass no mask on, so transformers sees the packing)
CASES["pp2_packed"] = {"world": 2, "arch": "llama8_tied", "seq": 256, "data": "packed", "layout": {"pp": 2}}
# 4-D: every dimension at once on 16 processes
CASES["dp2_cp2_tp2_pp2_ring_packed"] = {"world": 16, "arch": "llama8_tied", "seq": 256, "data": "packed",
                                       "layout": {"dp_shard": 2, "cp": 2, "tp": 2, "sequence_parallel": True,
                                                  "pp": 2}}
# context parallel with recomputation, bf16 and plain data parallel (DDP / ZeRO-1)
CASES.update({
    "cp2_ring_ac_full": {"world": 2, "arch": "llama", "seq": 256, "data": "packed",
                         "layout": {"cp": 2, "activation_checkpointing": "full"}},
    "cp2_ulysses_ac_selective": {"world": 2, "arch": "llama", "seq": 256, "data": "packed",
                                 "layout": {"cp": 2, "cp_method": "ulysses", "activation_checkpointing": "selective"}},
    "cp2_ring_bf16": {"world": 2, "arch": "llama", "seq": 256, "data": "padded", "tol": 2e-2,
                      "layout": {"cp": 2, "mixed_precision": "bf16"}},
    "cp2_ddp_dp2": {"world": 4, "arch": "llama", "seq": 256, "data": "packed",
                    "layout": {"cp": 2, "dp_shard": 2, "zero_stage": 0}},
    "cp2_zero1_dp2": {"world": 4, "arch": "llama", "seq": 256, "data": "padded",
                      "layout": {"cp": 2, "cp_method": "ulysses", "dp_shard": 2, "zero_stage": 1}},
})
CASES.update({
    "cp2_pp2_zbv_packed": {"world": 4, "arch": "llama8_tied", "seq": 256, "data": "packed",
                           "layout": {"cp": 2, "pp": 2, "pp_schedule": "zbv"}},
    "cp2_pp2_interleaved_ulysses": {"world": 4, "arch": "llama8_tied", "seq": 256, "data": "packed",
                                    "layout": {"cp": 2, "cp_method": "ulysses", "pp": 2,
                                               "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}},
})

# compile: regional (each decoder layer compiled by inductor) against the eager single-process run, composed
# with FSDP2 and full recomputation, TP without FSDP (local views) and selective recomputation, TP + SP, a
# pipeline and context parallel (TP with full recomputation is refused: tests/test_config.py)
COMPILED = {
    "compile_zero3_dp2_ac_full": (2, "llama", {"dp_shard": 2, "activation_checkpointing": "full"}, {}),
    "compile_tp2_ac_selective": (2, "llama", {"tp": 2, "activation_checkpointing": "selective"}, {}),
    "compile_dp2_tp2_sp": (4, "llama", {"dp_shard": 2, "tp": 2, "sequence_parallel": True}, {}),
    "compile_pp2_1f1b": (2, "llama8_tied", {"pp": 2, "pp_schedule": "1f1b"}, {}),
    "compile_cp2_ring_packed": (2, "llama", {"cp": 2}, {"seq": 256, "data": "packed"}),
}
for _name, (_world, _arch, _layout, _extra) in COMPILED.items():
    CASES[_name] = {"world": _world, "arch": _arch, "layout": {**_layout, "compile": "regional"}, "adamw": False,
                    **_extra}

# Expert parallelism (Qwen3-MoE, 8 experts, top-2): ep borrows its ranks from dp_shard x cp x tp; the experts are
# sharded by ZeRO over the rest (efsdp), in FSDP groups of their own
EP_CASES = {
    "ep2_zero3": (2, {"dp_shard": 2, "ep": 2}, {"roundtrip": True}),
    "ep2_zero2": (2, {"dp_shard": 2, "ep": 2, "zero_stage": 2}, {}),
    "ep2_tp2": (2, {"tp": 2, "ep": 2}, {}),  # ep is the tp ranks: each sends half of the tokens it shares
    "ep2_ac_full": (2, {"dp_shard": 2, "ep": 2, "activation_checkpointing": "full"}, {}),
    "ep2_bf16": (2, {"dp_shard": 2, "ep": 2, "mixed_precision": "bf16"}, {"tol": 2e-2}),
    "ep4_zero3": (4, {"dp_shard": 4, "ep": 4}, {}),
    "ep2_efsdp2": (4, {"dp_shard": 4, "ep": 2}, {"roundtrip": True}),
    "ep2_hsdp": (4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, {}),
    "ep2_dp2_tp2_sp": (4, {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "ep": 2}, {}),
    # ep independent of tp: the 4 ep ranks span both tp groups (each TP pair sends its halves of the tokens)
    "ep4_dp2_tp2": (4, {"dp_shard": 2, "tp": 2, "ep": 4}, {}),
    "ep2_cp2_ring": (4, {"dp_shard": 2, "cp": 2, "ep": 2}, {"seq": 32}),
    "ep2_pp2": (4, {"pp": 2, "dp_shard": 2, "ep": 2}, {}),
}
# torch's AdamW for-loop / foreach / fused across the two meshes (dense and experts) is compared on two of them; the
# others skip it (suite time)
EP_ADAMW = ("ep2_zero3", "ep2_dp2_tp2_sp")
for _name, (_world, _layout, _extra) in EP_CASES.items():
    CASES[_name] = {"world": _world, "arch": "qwen3_moe", "layout": _layout, "adamw": _name in EP_ADAMW, **_extra}

# The router auxiliary loss (Qwen3-MoE, coefficient 0.1) inside a pipeline: each micro-batch's own, from every
# stage's router logits and every replica's tokens, weighted by the micro-batch's share of the tokens, against one
# process accumulating the same global micro-batches ("accumulate": data-parallel replicas, micro-batches)
CASES.update({
    "aux_dp2": {"adamw": False, "world": 2, "arch": "qwen3_moe_aux", "layout": {"dp_shard": 2}},
    "aux_pp2_1f1b": {"adamw": False, "world": 2, "arch": "qwen3_moe_aux", "layout": {"pp": 2, "pp_schedule": "1f1b"},
                     "accumulate": (1, 2)},
    "aux_pp2_ep2": {"adamw": False, "world": 4, "arch": "qwen3_moe_aux", "layout": {"pp": 2, "dp_shard": 2, "ep": 2},
                    "accumulate": (2, 2)},
    "aux_pp2_zbv_tp2_sp": {"adamw": False, "world": 4, "arch": "qwen3_moe_aux",
                           "layout": {"pp": 2, "tp": 2, "sequence_parallel": True, "pp_schedule": "zbv",
                                      "pp_microbatches": 4}, "accumulate": (1, 4)},
})

# DeepSeek-V3's auxiliary-loss-free balancing (router_bias_update): the routers' selection biases move by the sign of
# each expert's load against the mean, counted over the whole step on every rank; the bias must be the same in
# every layout (it is a buffer of the state compared with one process's), and it changes the routing
BIAS_RATE = 0.02
CASES.update({
    "bias_dp2": {"adamw": False, "world": 2, "arch": "deepseek_v3",
                 "layout": {"dp_shard": 2, "router_bias_update": BIAS_RATE}},
    "bias_tp2_sp": {"adamw": False, "world": 2, "arch": "deepseek_v3",
                    "layout": {"tp": 2, "sequence_parallel": True, "router_bias_update": BIAS_RATE}},
    "bias_pp2_ep2": {"adamw": False, "world": 4, "arch": "deepseek_v3",
                     "layout": {"pp": 2, "dp_shard": 2, "ep": 2, "router_bias_update": BIAS_RATE},
                     "accumulate": (2, 2)},
    "bias_cp2_ep2_ac": {"adamw": False, "world": 4, "arch": "deepseek_v3", "seq": 32,
                        "layout": {"cp": 2, "dp_shard": 2, "ep": 2, "activation_checkpointing": "full",
                                   "router_bias_update": BIAS_RATE}},
})

# the chunked loss (head + cross-entropy 24 or 100 tokens at a time, no whole logits): over ZeRO-3 with
# accumulation, TP's two head inputs (a DTensor without SP; the plain gathered sequence under SP, tied), GPT-2's
# plan, a pipeline's last stage, context parallel on packed rows, bf16
CASES.update({
    "chunked_zero3_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "chunked_loss": 24},
                          "accumulate": (2, 2)},
    "chunked_tp2": {"world": 2, "arch": "llama", "layout": {"tp": 2, "chunked_loss": 24}},
    "chunked_tied_tp2_sp": {"world": 2, "arch": "llama_tied",
                            "layout": {"tp": 2, "sequence_parallel": True, "chunked_loss": 24}},
    "chunked_gpt2_dp2_tp2_sp": {"world": 4, "arch": "gpt2",
                                "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True, "chunked_loss": 24}},
    "chunked_pp2_1f1b": {"world": 2, "arch": "llama8_tied", "layout": {"pp": 2, "chunked_loss": 24}},
    "chunked_pp2_zbv": {"world": 2, "arch": "llama8_tied", "layout": {"pp": 2, "pp_schedule": "zbv",
                                                                      "chunked_loss": 24}},
    "chunked_cp2_ring_packed": {"world": 2, "arch": "llama", "seq": 256, "data": "packed",
                                "layout": {"cp": 2, "chunked_loss": 100}},
    "chunked_bf16_tp2": {"world": 2, "arch": "llama", "tol": 2e-2,
                         "layout": {"tp": 2, "mixed_precision": "bf16", "chunked_loss": 24}},
})

# weights, gradients and optimizer states held in bf16 (param_dtype: bf16): against the fp32 run at a bf16
# tolerance; ZeRO-3, TP + SP, a pipeline
CASES.update({
    "bf16_params_zero3_dp2": {"world": 2, "arch": "llama", "tol": 2e-2, "layout": {"dp_shard": 2, "param_dtype": "bf16"}},
    "bf16_params_tp2_sp": {"world": 2, "arch": "llama", "tol": 2e-2,
                           "layout": {"tp": 2, "sequence_parallel": True, "param_dtype": "bf16"}},
    "bf16_params_pp2": {"world": 2, "arch": "llama8_tied", "tol": 2e-2, "layout": {"pp": 2, "param_dtype": "bf16"}},
})

# the shards, their gradients and the optimizer states held on the host (cpu_offload: FSDP2's CPUOffloadPolicy):
# ZeRO-3 with accumulation, ZeRO-2 beside TP + SP, a pipeline's stages on one data-parallel rank (FSDP2 groups that
# shard nothing)
CASES.update({
    "offload_zero3_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "cpu_offload": True},
                          "accumulate": (2, 2), "roundtrip": True},
    "offload_zero2_dp2_tp2_sp": {"world": 4, "arch": "llama", "layout": {"dp_shard": 2, "tp": 2, "zero_stage": 2,
                                                                          "sequence_parallel": True,
                                                                          "cpu_offload": True}},
    "offload_pp2": {"world": 2, "arch": "llama8_tied", "layout": {"pp": 2, "cpu_offload": True}},
    # what the layers save for their backward held on the host (activation_offload): every saved activation under
    # ZeRO-3, the recomputed layers' inputs under TP + SP, a pipeline's stages
    "act_offload_zero3_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "activation_offload": True}},
    "act_offload_tp2_sp_ac_full": {"world": 2, "arch": "llama", "layout": {"tp": 2, "sequence_parallel": True,
                                                                           "activation_checkpointing": "full",
                                                                           "activation_offload": True}},
    "act_offload_pp2_1f1b": {"world": 2, "arch": "llama8_tied", "layout": {"pp": 2, "activation_offload": True}},
})

# torch's AdamW as for-loop, foreach and fused (tests/parity_worker.py: adamw_implementations_agree). An optimizer
# sees only the parameters and their gradients, so what decides whether foreach and fused run, and agree, is how a
# layout places its parameters: plain tensors (DDP, ZeroRedundancyOptimizer's partitions, a pipeline's stages, context
# parallel's replicas), FSDP2's shards on a 1-D or 2-D mesh, tensor-parallel DTensors (with and without the
# sequence-parallel norms, tied, Conv1D, biases), and their compositions. One case per placement runs it; the
# layouts that only change what runs between the optimizer steps (other schedules, recomputation, bf16 compute,
# context-parallel methods and data) skip it, as the compiled cases do (suite time: three more trainings each).
ADAMW_CASES = {
    "zero3_dp2", "zero1_dp2", "ddp_dp2", "tp2", "tp2_sp_loss_parallel", "tied_tp2", "tied_zero3_dp2", "gpt2_tp2",
    "qwen2_tp2", "bf16_zero3_dp2", "hsdp_2x2", "dp2_tp2", "dp2_tp2_sp", "zero2_dp2_tp2", "tied_dp2_tp2_sp",
    "gpt2_dp2_tp2_sp", "pp2_gpipe_llama8", "pp2_gpipe_llama8_tied", "pp4_1f1b_llama8", "pp2_zero3_dp2",
    "pp2_zero1_dp2", "pp2_ddp_dp2_gpt_neox", "pp2_tp2", "cp2_ring_padded", "cp2_dp2_ring_packed",
    "cp2_tp2_sp_ulysses_padded", "cp2_ddp_dp2", "cp2_zero1_dp2", "ddp_dp2_tp2", "zero1_dp2_tp2_sp", *EP_ADAMW,
    "offload_zero3_dp2",
}
for _name, _case in CASES.items():
    _case["adamw"] = _name in ADAMW_CASES

# The costliest compositions on 2 CPU cores (16 processes; regional compile of ZeRO-3 x TP + SP, of a pipeline and
# of context parallel; the 8-process cases but one) run in benchmarks/parity_large.py, results committed; CI runs
# every other case: the same dimensions in fewer at once (regional compile of ZeRO-3 and of TP; cp x tp, cp x pp,
# dp x cp on 4), and pp x tp x dp as Frontier runs it (pp2_tp2_dp2_zero1).
LARGE = ("dp2_cp2_tp2_pp2_ring_packed", "compile_dp2_tp2_sp", "pp2_tp2_dp2_sp", "pp2_tp2_dp2_zbv",
         "dp2_cp2_tp2_ring_packed", "dp2_cp2_tp2_ulysses_padded", "cp2_tp2_pp2_ring_packed",
         "cp2_tp2_pp2_ulysses_padded", "compile_pp2_1f1b", "compile_cp2_ring_packed")
CI_CASES = {name: case for name, case in CASES.items() if name not in LARGE}

"""Every layout proven against one process: name -> (world size, architecture, ParallelConfig fields)."""

CASES = {
    # 2 ranks
    "zero3_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "zero_stage": 3}},
    "zero2_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "zero_stage": 2}},
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
    "tied_dp2_tp2_sp": {"world": 4, "arch": "llama_tied",
                        "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True}},
    "gpt2_dp2_tp2_sp": {"world": 4, "arch": "gpt2", "layout": {"dp_shard": 2, "tp": 2, "sequence_parallel": True}},
}

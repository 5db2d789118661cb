"""Every layout proven against one process: name -> (world size, architecture, ParallelConfig fields)."""

CASES = {
    # 2 ranks
    "zero3_dp2": {"world": 2, "arch": "llama", "layout": {"dp_shard": 2, "zero_stage": 3}, "roundtrip": True},
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
    "pp2_zero3_dp2": {"world": 4, "arch": "llama8_tied", "layout": {"pp": 2, "dp_shard": 2}, "roundtrip": True},
    "pp2_zero2_dp2_interleaved": {"world": 4, "arch": "llama8",
                                  "layout": {"pp": 2, "dp_shard": 2, "zero_stage": 2,
                                             "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}},
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
    "pp2_tp2_sp_interleaved": {"world": 4, "arch": "llama8_tied",
                               "layout": {"pp": 2, "tp": 2, "sequence_parallel": True,
                                          "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}},
    "pp2_tp2_dp2_sp": {"world": 8, "arch": "llama8_tied",
                       "layout": {"pp": 2, "tp": 2, "dp_shard": 2, "sequence_parallel": True}},
    "pp2_tp2_dp2_zbv": {"world": 8, "arch": "llama8", "layout": {"pp": 2, "tp": 2, "dp_shard": 2,
                                                                 "pp_schedule": "zbv"}},
})

# Layouts with the out-of-package plugin's axis (tests/outside_plugin: ``acme_dp`` splits each replica's rows,
# averages gradients, counts tokens). Run by tests/test_outside_plugin.py with the plugin on PYTHONPATH.
OUTSIDE_CASES = {
    "acme2_zero3_dp2": {"world": 4, "arch": "llama", "layout": {"acme_dp": 2, "dp_shard": 2}, "roundtrip": True},
    "acme2_tp2_sp": {"world": 4, "arch": "llama", "layout": {"acme_dp": 2, "tp": 2, "sequence_parallel": True}},
    "acme2_pp2": {"world": 4, "arch": "llama8_tied", "layout": {"acme_dp": 2, "pp": 2, "pp_microbatches": 2}},
}

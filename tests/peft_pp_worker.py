"""PEFT (LoRA) models under pipeline parallel against the same PEFT model in one process (see tests/test_peft_pp.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/peft_pp_worker.py OUT.json CASE...

The cases run through tests/peft_worker.py's harness (its ``run``: training under the layout, the one-process
reference, the frozen base, the gradient and optimizer bytes against the estimate), with the pipeline layouts
added to its cases and deeper tiny models for the schedules that place two stages on each rank (4 stages need
4 decoder layers). ``eval:CASE`` compares the pipeline's forward-only pass (``eval_step``) with the PEFT model's
loss in one process.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peft_worker  # noqa: E402
from models import rows  # noqa: E402

import ultrascale_plugins as us  # noqa: E402

PP = {"pp": 2, "dp_shard": 1}
V2 = {"pp_virtual_stages": 2}
LATE = r".*layers\.[23]\..*_proj"  # LoRA on the last two of four layers: the first stages train nothing
CASES = {
    # every schedule at pp=2; LoRA on every linear layer of a frozen base
    "pp2_gpipe_llama": ("llama", {**PP, "pp_schedule": "gpipe"}, {"save": True, "task_type": "CAUSAL_LM"}),
    "pp2_1f1b_qwen3_moe": ("qwen3_moe", {**PP, "pp_schedule": "1f1b"}, {}),
    "pp2_1f1b_dora_llama": ("llama", {**PP, "pp_schedule": "1f1b"}, {"use_dora": True}),  # DoRA's weight norms
    "pp2_interleaved_llama4": ("llama4", {**PP, "pp_schedule": "interleaved_1f1b", **V2}, {}),
    "pp2_zero_bubble_qwen3_moe4": ("qwen3_moe4", {**PP, "pp_schedule": "zero_bubble", **V2}, {}),
    "pp2_zbv_llama4": ("llama4", {**PP, "pp_schedule": "zbv"}, {}),
    "pp2_dualpipev_qwen3_moe4": ("qwen3_moe4", {**PP, "pp_schedule": "dualpipev"}, {}),
    # the schedules that split weight from input gradients, with frozen first stages (see pipeline_split's
    # build_stage: without a graph from the first stage their W pass gave the adapters no gradient)
    "pp2_zero_bubble_llama4_late": ("llama4", {**PP, "pp_schedule": "zero_bubble", **V2}, {"target_modules": LATE}),
    "pp2_dualpipev_llama4_late": ("llama4", {**PP, "pp_schedule": "dualpipev"}, {"target_modules": LATE}),
    "pp2_1f1b_llama4_late": ("llama4", {**PP, "pp_schedule": "1f1b"}, {"target_modules": LATE}),
    # PEFT's ModulesToSaveWrapper around the head (a trainable copy, on the last stage only) of a tied model
    "pp2_1f1b_tied_llama_head": ("tied_llama", {**PP, "pp_schedule": "1f1b"}, {"modules_to_save": ["lm_head"]}),
}
# four processes: the pipeline composed with ZeRO-3 over dp_shard=2
CASES4 = {"pp2_zero3_dp2_1f1b_llama": ("llama", {"pp": 2, "dp_shard": 2, "pp_schedule": "1f1b"}, {}),
          "pp2_zero3_dp2_zbv_llama4_late": ("llama4", {"pp": 2, "dp_shard": 2, "pp_schedule": "zbv"},
                                            {"target_modules": LATE})}

_base_model = peft_worker.base_model


def base_model(arch: str):
    """peft_worker's tiny models, plus 4-layer ones ("llama4", "qwen3_moe4") for two stages per rank."""
    if not arch.endswith("4"):
        return _base_model(arch)
    from transformers import AutoModelForCausalLM

    config = _base_model(arch[:-1]).config
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def install() -> None:
    """peft_worker's functions build their models through its module-level ``base_model`` and read its ``CASES``:
    add these there, in the worker process only (importing this module, as the tests do, changes nothing)."""
    peft_worker.base_model = base_model
    peft_worker.CASES.update(CASES)
    peft_worker.CASES.update(CASES4)


def evaluate(name: str) -> dict:
    """``eval_step`` on the first batch against the PEFT model's own loss in one process."""
    arch, layout, extra = peft_worker.CASES[name]
    model = peft_worker.peft_model(arch, extra)
    batch = peft_worker.batches(extra)[0]
    with torch.no_grad():
        ref = model(**batch, use_cache=False).loss.item()
    pmodel = us.parallelize(model, us.ParallelConfig(**layout))
    got = pmodel.eval_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size)).item()
    return {"eval_diff": abs(got - ref), "loss": got, "ref_loss": ref}


def main() -> None:
    install()
    peft_worker.run_cases(sys.argv[1], sys.argv[2:],
                          lambda name: evaluate(name[5:]) if name.startswith("eval:") else peft_worker.run(name),
                          "peft-pp", peft_worker.CASES)


if __name__ == "__main__":
    main()

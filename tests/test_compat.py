"""The CI subset of the compatibility sweep (benchmarks/compat_matrix.py): one model per class of failure the sweep
found and fixed, plus mixture-of-experts models with their routing compared token by token, and the refusals —
each cell either reproduces one process (loss, global gradient norm with clipping active, final weights) or is
refused with a ConfigError before training."""
import json
import sys
from pathlib import Path

import pytest

from conftest import torchrun

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

EXPECT = {
    # world 2
    "gemma2:tp2_sp": "pass",       # four norms per layer: every module between regions runs on sequence shards
    "phi3:tp2_sp": "pass",         # fused qkv_proj gathered inside the region
    "olmo2:tp2_sp": "pass",        # q_norm / k_norm over the whole projection
    "deepseek_v3:tp2": "pass",     # latent attention, TP experts + shared experts, routing compared
    "qwen2_moe:tp2_sp": "pass",    # a router, and a shared expert the package shards, its sigmoid gate keeping
                                   # its output partial, read the MoE block's input (one sum, reduced once)
    "gpt_oss:tp2_sp": "pass",      # attention and biased experts outside the TP plan run on the gathered sequence
    "bamba:tp2_sp": "pass",        # Mamba mixers outside the TP plan run on the gathered sequence
    "inkling_text:tp2_sp": "pass",  # shared experts as bare 3-D weights, scaled by routing gammas, sharded
    "axk1:tp2_sp": "pass",         # a norm on the MoE block's sum: reduce-scattered at the norm's input
    "hrm_text:tp2_sp": "refused",  # mixes the split sequence with full-length states (crashed mid-step)
    "gpt2:pp2": "refused",         # no pipeline plan
    # context parallel: the attention functions under sliding windows + soft-capping, per-head norms, MoE routing
    "gemma2:cp2_ring": "pass",
    "qwen3:cp2_ulysses": "pass",
    "mixtral:cp2_aux": "pass",     # router auxiliary loss over the cp ranks' tokens
    "gpt_oss:cp2_ring": "pass",    # attention sinks join the merged softmax
    "bamba:cp2_ulysses": "refused",  # Mamba mixers over the sequence
    # world 4
    "qwen3:dp2_tp2_sp": "pass",    # per-head norms replicated over TP under FSDP (was silently wrong)
    "mixtral:dp2_tp2_sp": "pass",  # TP experts under FSDP + SP, routing compared
    "qwen3_moe:dp2_tp2_sp": "pass",
    "qwen3_next:dp2_tp2_sp": "pass",  # head-parallel linear attention: a whole convolution, its rows per rank
    "minimax_m3_vl_text:dp2_tp2_sp": "pass",  # a packed gate|up shared expert, FSDP-sharded by columns
    "llama:pp2_zbv_tp2_sp": "pass",  # zero-bubble schedules with SP (crashed: in-place detach of a view)
    # router auxiliary loss on (output_router_logits): global router statistics, equal to one process's
    "mixtral:dp2_aux": "pass",     # (granitemoe's own aux-loss code fails in one process under transformers 5.17)
    "qwen3_moe:dp2_tp2_sp_aux": "pass",
    # LoRA adapters sharded like their base layers under ZeRO-3 x TP + SP
    "phi3:lora_dp2_tp2_sp": "pass",      # fused qkv / gate|up projections
    "qwen3_moe:lora_dp2_tp2_sp": "pass",  # adapters on attention beside TP experts, routing compared
    "gpt2:lora_dp2_tp2_sp": "refused",   # fused Conv1D styles adapters cannot follow
    "minicpm3:lora_dp2_tp2_sp": "pass",  # latent attention: the rotary-gradient style stays on the LoRA layer
    "qwen3_moe:lora_pp2": "pass",        # pipeline stages of a PEFT model, LoRA on the fused experts too
    # expert parallelism: experts split over ep ranks borrowed from data / tensor parallelism, routing compared
    "gpt_oss:ep2": "pass",               # interleaved, transposed gate|up with biases
    "ergo:ep2": "pass",                  # no gate (up_proj only) and a per-expert norm split with the experts
    "mixtral:ep2_aux": "pass",           # router auxiliary loss over every rank's tokens
    "deepseek_v3:ep2_tp2_sp": "pass",    # shared experts under TP + SP beside the split experts
    "qwen3_moe:pp2_ep2": "pass",
    "qwen3_moe:ep2_tp2_sp_aux": "pass",
    "mixtral:ep4": "pass",
    "gpt_oss:ep2_dp2": "pass",           # experts sharded by ZeRO-3 over efsdp=2 too
}


# cells whose fix a CI parity case also covers (router statistics under TP + SP and EP, ep4, ep under a pipeline,
# LoRA in a pipeline: tests/parity_cases.py, tests/test_peft_pp.py): run by benchmarks/sweep_tests.py
SWEEP_CELLS = ("qwen3_moe:dp2_tp2_sp_aux", "qwen3_moe:ep2_tp2_sp_aux", "mixtral:ep4", "qwen3_moe:pp2_ep2",
               "qwen3_moe:lora_pp2")


def _run_cells(out, names):
    from compat.layouts import ALL

    failures = {}
    for world in (2, 4):
        cases = [c for c in names if ALL[c.split(":")[1]][0] == world]
        if not cases:
            continue
        proc = torchrun(world, ROOT / "benchmarks/compat/worker.py", str(out), *cases, timeout=900)
        if proc.returncode != 0:
            failures.update({c: proc.stderr[-5000:] for c in cases})
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return {r["case"]: r for r in rows}, failures


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return _run_cells(tmp_path_factory.mktemp("compat") / "cells.jsonl", [c for c in EXPECT if c not in SWEEP_CELLS])


@pytest.fixture(scope="module")
def sweep_cells(tmp_path_factory):
    return _run_cells(tmp_path_factory.mktemp("compat_sweep") / "cells.jsonl", SWEEP_CELLS)


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.sweep] * (c in SWEEP_CELLS)) for c in EXPECT])
def test_cell(case, request):
    from compat_matrix import verdict

    results, failures = request.getfixturevalue("sweep_cells" if case in SWEEP_CELLS else "cells")
    assert case not in failures, failures[case]
    r = results[case]
    assert verdict(r) == EXPECT[case], r
    if EXPECT[case] == "pass":
        assert r["clipped"]
        if "routing_match" in r:
            assert r["routing_match"] and r["routed_tokens"] > 0


def test_refusals_need_no_process_group():
    """What the module tree rules out is refused by validate() on a meta-device model, before any process group."""
    import torch
    import torch.distributed as dist
    from compat.tiny import build_model, tiny_config
    from transformers import AutoModelForCausalLM

    import ultrascale_plugins as us
    from ultrascale_plugins.core.engine import validate

    with torch.device("meta"):
        oss = build_model("gpt_oss")
        gpt2 = build_model("gpt2")
        hrm = build_model("hrm_text")
    with pytest.raises(us.ConfigError, match="hrm_text.*sequence split.*sequence_parallel: false"):
        validate(us.ParallelConfig(tp=2, sequence_parallel=True), hrm.config, 2, model=hrm)
    validate(us.ParallelConfig(tp=2, sequence_parallel=True), oss.config, 2, model=oss)
    with torch.device("meta"):
        doge, dsa = build_model("doge"), build_model("glm_moe_dsa")
    with pytest.raises(us.ConfigError, match="doge.*tensor-parallel plan's shards.*tp: 1"):  # crashed mid-step
        validate(us.ParallelConfig(tp=2), doge.config, 2, model=doge)
    with pytest.raises(us.ConfigError, match="glm_moe_dsa.*state besides the hidden states.*pp: 1"):
        validate(us.ParallelConfig(pp=2), dsa.config, 2, model=dsa)
    with pytest.raises(us.ConfigError, match="no usable pipeline plan"):
        validate(us.ParallelConfig(pp=2), gpt2.config, 2, model=gpt2)
    moe = tiny_config("mixtral")
    moe.output_router_logits = True
    with torch.device("meta"):
        mixtral = AutoModelForCausalLM.from_config(moe)
    validate(us.ParallelConfig(pp=2), moe, 2, model=mixtral)  # the auxiliary loss runs inside a pipeline too
    validate(us.ParallelConfig(dp_shard=2), moe, 2, model=mixtral)  # and under data parallel
    with pytest.raises(us.ConfigError, match="ep=3.*dp_shard\\*cp\\*tp = 2\\*1\\*1 = 2.*ep that divides 2"):
        validate(us.ParallelConfig(dp_shard=2, ep=3), moe, 2, model=mixtral)
    with pytest.raises(us.ConfigError, match="zero_stage=1.*ep=2.*FSDP2 groups.*zero_stage: 2 or 3, or ep: 1"):
        validate(us.ParallelConfig(dp_shard=2, ep=2, zero_stage=1), moe, 2, model=mixtral)
    with pytest.raises(us.ConfigError, match="ep=2.*'gpt2' has no routed experts.*ep: 1"):
        validate(us.ParallelConfig(dp_shard=2, ep=2), gpt2.config, 2, model=gpt2)
    assert not dist.is_initialized()


def test_what_the_plan_less_sweep_found_is_fixed_or_refused_before_any_process_group():
    """Found by sweeping the types without a TP/PP plan under ZeRO-3: causal-LM heads whose own loss does not shift
    the labels trained another objective (refused); a tied embedding grouped apart from its head and nested Mamba
    blocks crashed FSDP (each "no split" module gets a group only when outermost and not tied outside)."""
    import torch
    import torch.distributed as dist
    from compat.tiny import build_model

    import ultrascale_plugins as us
    from ultrascale_plugins.dims.data_parallel.plugin import fsdp_groups
    from ultrascale_plugins.core.engine import ParallelContext, validate
    from ultrascale_plugins.interface.parallel_dims import ParallelDims

    with torch.device("meta"):
        xlnet, roberta, mamba = build_model("xlnet"), build_model("roberta"), build_model("mamba")
    with pytest.raises(us.ConfigError, match="'xlnet': XLNetLMHeadModel computes its own loss on labels it does not "
                                             "shift"):
        validate(us.ParallelConfig(dp_shard=2), xlnet.config, 2, model=xlnet)
    for model in (roberta, mamba):
        config = validate(us.ParallelConfig(dp_shard=2), model.config, 2, model=model)
        ctx = ParallelContext(dims=ParallelDims(config, 2), plan=None, device=torch.device("cpu"))
        groups = fsdp_groups(model, ctx.plan_layers(model))
        assert groups and not any(g.startswith(h + ".") for g in groups for h in groups if g != h)  # outermost
        tied = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
                if n.endswith("word_embeddings.weight") or n.startswith("lm_head")}
        assert not any(id(p) in tied for g in groups for p in model.get_submodule(g).parameters())
    assert not dist.is_initialized()


def test_fused_experts_get_tp_entries_from_their_layout():
    """transformers 5.25 moved the fused experts from the TP plan to the EP plan: the plan shards them again by
    their intermediate dimension when their layout says how (concatenated gate|up, no biases), and leaves them
    whole otherwise (gpt-oss: biases, interleaved gate/up)."""
    import torch
    from compat.tiny import build_model

    from ultrascale_plugins.models.hf_plan import full_tp_plan

    with torch.device("meta"):
        mixtral, oss = build_model("mixtral"), build_model("gpt_oss")
    plan = full_tp_plan(mixtral)
    experts = "model.layers.*.mlp.experts"
    assert plan[experts] == "moe_tp_experts"
    assert plan[experts + ".gate_up_proj"] == "packed_colwise" and plan[experts + ".down_proj"] == "rowwise"
    assert not any("experts" in k for k in full_tp_plan(oss))

"""Tensor parallel's activation collectives per step, counted in one process on a fake 2-rank group.

Megatron's count per decoder layer: forward, one all-reduce (TP) or one all-gather + one reduce-scatter (SP) per
region (attention, MLP); the backward mirrors it. A region reduces its input's gradient once, after the
column-parallel projections' partial gradients are summed locally. The fake process group moves no data, so this
counts collectives without a launch; the values are proven by the parity cases (tests/parity_cases.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ACTIVATION = 1000  # elements: a tiny model's activation (4 x 16 x 64 / tp) against norm weights and routing values
# Per step of a 2-layer model, activation-sized collectives only (norm weights, routing values and LoRA's r-wide
# ones are below ACTIVATION). L = 2 layers, 2 regions each.
L = 2
# The embedding is vocabulary-parallel (tied or not): its partial output is summed once, reduce-scattered onto the
# sequence shards under SP.
TP = {"forward": {"all_reduce": 2 * L + 1, "all_gather": 1},  # the embedding's, each region's output; the logits'
      "backward": {"all_reduce": 2 * L + 1}}  # each region's input; the head's input
SP = {"forward": {"all_gather": 2 * L + 2, "reduce_scatter": 2 * L + 1},  # + the last layer's gather, the logits'
      "backward": {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L + 1}}  # + the first layer's split; the head
EXPECTED = {
    "llama:tp": TP, "llama:sp": SP, "qwen3:sp": SP, "qwen3_moe:sp": SP,
    # a shared expert sharded like the routed ones, its sigmoid gate multiplying its partial output: one sum
    "qwen2_moe:tp": TP, "qwen2_moe:sp": SP,
    # head-parallel linear attention (each rank its key heads and their value heads) beside softmax attention
    "qwen3_next:tp": TP, "qwen3_next:sp": SP,
    # a tied embedding is vocabulary-parallel like an untied one (its weight is the head's)
    "llama_tied:sp": SP,
    # GPT-2: the vocabulary-parallel embedding is added to a replicated position embedding: reduced whole
    "gpt2:sp": {"forward": {**SP["forward"], "reduce_scatter": 2 * L, "all_reduce": 1}, "backward": SP["backward"]},
    # latent attention: kv_b_proj reads the replicated latent, not the region's input, and reduces its own
    # (rank-wide: kv_lora_rank, not hidden) input gradient
    "deepseek_v3:tp": {"forward": TP["forward"], "backward": {"all_reduce": 2 * L + 1 + L}},
    "deepseek_v3:sp": {"forward": SP["forward"], "backward": {**SP["backward"], "all_reduce": L}},
    # A.X-K1: a norm on the MoE block's sum inside the block: the sum reduced (scattered) at the norm's input. Its
    # latent attention has a query latent too: the two down-projections read the block's input whole (no reduction
    # there), and each latent's gradient is all-reduced (two per layer)
    "axk1:tp": {"forward": TP["forward"], "backward": {"all_reduce": L + 1 + 2 * L}},
    "axk1:sp": {"forward": SP["forward"], "backward": {"all_gather": 2 * L + 1, "reduce_scatter": L + 1,
                                                       "all_reduce": 2 * L}},
    # LoRA on every linear layer (frozen embedding: the first region's input and the split need no gradient)
    "llama+lora:sp": {"forward": SP["forward"], "backward": {"all_gather": 2 * L, "reduce_scatter": 2 * L}},
}
CASES = list(EXPECTED)


def _count(arch: str, layout: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import ultrascale_plugins as us
    from models import make_model

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                if op in name and "wait" not in name and args and torch.is_tensor(args[0]):
                    self.seen[op if args[0].numel() >= ACTIVATION else op + " (small)"] += 1
            return func(*args, **(kwargs or {}))

    model = make_model(arch.removesuffix("+lora"))
    if arch.endswith("+lora"):  # every linear layer of the decoder, as the PEFT tests do
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"]))
    pmodel = us.parallelize(model, us.ParallelConfig(tp=2, dp_shard=1, sequence_parallel=layout == "sp"))
    ids = torch.randint(0, 256, (4, 16))
    with Count() as fwd:
        out = pmodel.module(input_ids=ids, labels=ids)
    with Count() as bwd:
        out.loss.backward()
    grad = pmodel.module.get_input_embeddings().weight.grad
    rows = None if grad is None else (grad.to_local() if hasattr(grad, "to_local") else grad).shape[0]
    dist.destroy_process_group()
    return {"forward": dict(fwd.seen), "backward": dict(bwd.seen), "embedding_grad_rows": rows}


def main(cases: list[str]) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(Path(__file__).parent))
    os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    out = {}
    for case in cases:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        out[case] = _count(*case.split(":"))
    print(json.dumps(out))


@pytest.fixture(scope="module")
def counts():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, __file__, *CASES], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _activations(seen: dict) -> dict:
    return {op: n for op, n in seen.items() if "small" not in op}


@pytest.mark.parametrize("case", CASES)
def test_one_collective_per_region_forward_and_backward(counts, case):
    got = {phase: _activations(counts[case][phase]) for phase in ("forward", "backward")}
    assert got == EXPECTED[case], (case, counts[case])


def test_the_embedding_is_vocabulary_parallel_and_its_gradient_is_this_ranks_rows(counts):
    """Tied or not, the embedding is split by vocabulary rows under TP, and the gradient a rank holds (and data
    parallel reduces) is its own rows: 128 of the tiny models' 256, not the whole table torch's vocabulary-parallel
    lookup hands back. A frozen embedding (LoRA) has none."""
    for case in ("llama:tp", "llama:sp", "llama_tied:sp", "gpt2:sp", "qwen3_moe:sp", "deepseek_v3:tp"):
        assert counts[case]["embedding_grad_rows"] == 128, (case, counts[case]["embedding_grad_rows"])
    assert counts["llama+lora:sp"]["embedding_grad_rows"] is None


def test_a_region_whose_input_meets_anything_else_reduces_per_projection(monkeypatch):
    """A region's input added to its output (a residual inside the region) would be summed tp times if the
    region reduced its input's gradient once: the trace keeps that region on one reduction per projection."""
    import torch
    from transformers.models.llama import modeling_llama

    import ultrascale_plugins as us
    from models import make_config
    from ultrascale_plugins.core.engine import model_plan
    from ultrascale_plugins.models.dataflow import trace_tp

    with torch.device("meta"):
        model = modeling_llama.LlamaForCausalLM(make_config("llama"))
    plan = model_plan(model, us.ParallelConfig(tp=2, dp_shard=1))
    everything = lambda fqn, style, module: style == "colwise"  # noqa: E731
    assert set(trace_tp(model, plan, everything).block) == set(plan.regions)
    mlp = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: mlp(self, x) + x)
    block = trace_tp(model, plan, everything).block
    assert set(block) == {r for r in plan.regions if r.endswith("self_attn")}, block


def test_a_shared_expert_is_sharded_like_an_mlp_and_a_biased_packed_linear_is_refused_under_fsdp():
    """transformers' Qwen2-MoE plan leaves the shared expert whole on every rank: the package shards it (gate and up
    column-parallel, down row-parallel), so the MoE block's output is one sum (counted above); a concatenated
    gate|up (MiniMax-M3's) gets a packed shard. FSDP shards a packed weight by columns (a row shard nested in the
    strided one came out of the optimizer step wrong: the compatibility cell minimax_m3_vl_text:dp2_tp2_sp proves
    the values); a bias has no other dim, so a biased packed Linear is refused under FSDP, before any process
    group."""
    import torch

    import ultrascale_plugins as us
    from models import make_config
    from transformers import AutoModelForCausalLM
    from ultrascale_plugins.interface.config import ConfigError
    from ultrascale_plugins.dims.tensor.plugin import ultrascale_validate_model
    from ultrascale_plugins.core.engine import model_plan

    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(make_config("qwen2_moe"))
    matched = model_plan(moe, us.ParallelConfig(tp=2, dp_shard=1)).matches(moe)
    assert {k.rpartition(".")[2]: v for k, v in matched.items() if ".0.mlp.shared_expert." in k} == {
        "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    with torch.device("meta"):
        qwen2 = AutoModelForCausalLM.from_config(make_config("qwen2"))  # q/k/v projections with biases
    config = us.ParallelConfig(tp=2, dp_shard=2, zero_stage=3)
    plan = model_plan(qwen2, config)
    plan.tp_plan["model.layers.*.mlp.up_proj"] = "packed_colwise"  # bias-free: sharded by columns under FSDP
    ultrascale_validate_model(qwen2, plan, config)
    plan.tp_plan["model.layers.*.self_attn.q_proj"] = "packed_colwise"
    with pytest.raises(ConfigError, match="'model.layers.0.self_attn.q_proj'.*'packed_colwise'.*bias.*FSDP.*zero_stage: 0"):
        ultrascale_validate_model(qwen2, plan, config)
    ultrascale_validate_model(qwen2, plan, us.ParallelConfig(tp=2, dp_shard=2, zero_stage=0))


def test_linear_attention_is_head_parallel_where_tp_divides_its_key_heads():
    """Qwen3-Next's gated delta-net layers: transformers' plan gathers every projection (the layer runs whole on
    every rank); the package shards them by key head (counted above, values proven by the compatibility cell
    qwen3_next:dp2_tp2_sp), and keeps the model's plan where tp does not divide the key heads."""
    import torch

    import ultrascale_plugins as us
    from models import make_config
    from transformers import AutoModelForCausalLM
    from ultrascale_plugins.core.engine import model_plan

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config("qwen3_next"))  # 2 key heads, 4 value heads

    def layer(tp):
        plan = model_plan(model, us.ParallelConfig(tp=tp, dp_shard=1))
        matched = {**plan.matches(model), **plan.param_matches(model)}
        return {k.rpartition("linear_attn")[2]: v for k, v in matched.items() if "layers.0.linear_attn" in k}

    assert layer(2) == {"": "delta_net_heads", ".in_proj_qkvz": "colwise", ".in_proj_ba": "colwise",
                        ".out_proj": "rowwise", ".A_log": "colwise", ".dt_bias": "colwise"}
    assert set(layer(4).values()) == {"colwise_gather_output"}


if __name__ == "__main__":
    main(sys.argv[1:])

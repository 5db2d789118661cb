"""Each dimension contributes its memory and communication terms through ``ultrascale_cost_estimate``; parameter,
gradient and optimizer bytes come from the model's own parameters, cut by each dimension in turn."""
import math

import pytest

import ultrascale_plugins as us
from models import make_config, make_model
from ultrascale_plugins.core.inventory import inventory
from ultrascale_plugins.interface.estimates import chunk_size, parameter_count


def _numels(arch):
    return [p.numel() for p in make_model(arch).parameters()]


def test_parameter_count_matches_the_model():
    for arch in ("llama", "llama_tied", "qwen2"):
        exact = sum(_numels(arch))
        assert abs(parameter_count(make_config(arch)) - exact) / exact < 0.01, arch
        assert sum(r.numel for r in inventory(make_model(arch), pm=us.get_plugin_manager())) == exact  # the inventory is exact, tied once


def test_zero_stages_shrink_model_states_exactly():
    mc = make_config("llama")
    numels = _numels("llama")
    psi, tensors = sum(numels), len(numels)

    def states(z, **kw):
        memory = us.estimate(us.ParallelConfig(zero_stage=z, dp_shard=4), mc, world_size=4, **kw).memory
        return memory["params"], memory["grads"], memory["optimizer"]

    # fp32 AdamW: 4 + 4 + 2 x 4 bytes per element, plus a 4-byte step counter per tensor
    assert states(0) == (4 * psi, 4 * psi, 8 * psi + 4 * tensors)
    # ZeRO-3: every tensor's dim 0 in ceil-sized chunks; rank 0 holds the first (the most loaded)
    shard0 = sum(chunk_size(n_rows, 4, 0) * n // n_rows
                 for n_rows, n in ((p.shape[0], p.numel()) for p in make_model("llama").parameters()))
    assert states(3)[0] == 4 * shard0
    assert states(3, coords={"dp_shard": 3})[0] <= states(3)[0]
    # ZeRO-1: whole tensors, largest first to the least loaded rank (ZeroRedundancyOptimizer's partition)
    per_rank = [states(1, coords={"dp_shard": r})[2] for r in range(4)]
    assert sum(per_rank) == 8 * psi + 4 * tensors
    assert states(1)[2] == max(per_rank)
    # SGD with momentum keeps one buffer per parameter and no step counter
    assert states(0, optimizer="sgd_momentum")[2] == 4 * psi


def test_tp_cuts_what_the_plan_shards_and_adds_its_collectives():
    mc = make_config("llama")
    dp_only = us.estimate(us.ParallelConfig(dp_shard=2, zero_stage=3), mc, world_size=2, seq_len=16)
    tp = us.estimate(us.ParallelConfig(tp=2, dp_shard=1), mc, world_size=2, seq_len=16)
    assert "tp" in tp.comm and "tp" not in dp_only.comm  # communication per mesh axis
    assert "dp_shard" in dp_only.comm and "dp_shard" not in tp.comm
    psi = sum(_numels("llama"))
    # the layers' projections are halved, norms (and what the plan leaves whole) are not; exact per-rank holdings
    # are checked against real TP ranks in the parity launches (test_parity)
    assert 4 * psi / 2 < tp.memory["params"] < 4 * psi


def test_pipeline_ranks_hold_their_stages_and_a_tied_head_copy():
    mc = make_config("llama8_tied")
    model = make_model("llama8_tied")
    embed = model.get_input_embeddings().weight.numel()
    one = us.estimate(us.ParallelConfig(dp_shard=1), mc, world_size=1, model=model)
    first, last = (us.estimate(us.ParallelConfig(pp=2, dp_shard=1), mc, world_size=2, model=model, coords={"pp": r},
                               micro_batches=4) for r in (0, 1))
    # both ends hold the tied embedding/head; together they hold one more copy of it than the whole model
    assert first.memory["params"] + last.memory["params"] == one.memory["params"] + 4 * embed
    assert first.factors["bubble"] == pytest.approx(1 / 4)  # 1F1B: (p - 1) / m
    assert first.memory["activations"] > 0 and "pp" in first.comm


def test_memory_comes_in_the_planner_categories():
    est = us.estimate(us.ParallelConfig(tp=2, sequence_parallel=True, activation_checkpointing="full", dp_shard=1),
                      make_config("llama"), world_size=2, seq_len=64)
    assert set(est.memory) == {"params", "grads", "optimizer", "activations", "other"}
    assert est.memory["activations"] > 0 and est.factors["recompute_flops"] > 1
    # the rank's peak: every category at once (the backward), or the optimizer step's memory if larger (here:
    # foreach AdamW's temporary, one fp32 copy of the optimizer's elements, beside tiny activations)
    step = est.memory["params"] + est.memory["grads"] + est.memory["optimizer"] + est.factors["step_temporary"]
    assert est.factors["step_temporary"] == pytest.approx(est.memory["grads"])  # fp32, unsharded: the same size
    assert est.optimizer_step_memory == pytest.approx(step)
    assert est.total_memory == pytest.approx(max(sum(est.memory.values()), step))


def test_recomputation_and_sequence_parallel_shrink_activations():
    mc = make_config("llama")

    def act(**kw):
        cfg = us.ParallelConfig(dp_shard=1, **kw)
        return us.estimate(cfg, mc, world_size=cfg.tp, seq_len=512).memory["activations"]

    assert act(activation_checkpointing="full") < act(activation_checkpointing="selective") < act()
    assert act(tp=2, sequence_parallel=True) < act(tp=2) < act()


def test_estimate_validates_the_layout_unless_told_not_to():
    with pytest.raises(us.ConfigError, match="world size is 3"):
        us.estimate(us.ParallelConfig(tp=2, dp_shard=2), make_config("llama"), world_size=3)
    # a layout the engine refuses can still be costed (the planner's "runnable": false)
    cfg = us.ParallelConfig(tp=2, dp_shard=2, zero_stage=1, grad_sync="micro_batch")
    with pytest.raises(us.ConfigError):
        us.estimate(cfg, make_config("llama"), world_size=4)
    assert us.estimate(cfg, make_config("llama"), world_size=4, check=False).memory["optimizer"] > 0
    assert not math.isnan(us.estimate(cfg, make_config("llama"), world_size=4, check=False).total_memory)


def test_grad_sync_is_priced():
    """Over 4 micro-batches: ZeRO-2 gathers the weights once per step (they stay gathered) and reduce-scatters
    every micro-batch; grad_sync: step reduce-scatters once and holds every whole fp32 gradient over the step; ZeRO-3
    reduced every micro-batch gathers twice per micro-batch (the root group once). In units of the model's fp32 bytes Ψ per rank."""
    mc = make_config("llama")

    def estimate(**fields):
        return us.estimate(us.ParallelConfig(dp_shard=2, **fields), mc, world_size=2, seq_len=16, micro_batches=4)

    psi = 4 * sum(_numels("llama"))
    units = {k: estimate(**f).comm["dp_shard"] / psi for k, f in {
        "zero2": {"zero_stage": 2}, "zero2_step": {"zero_stage": 2, "grad_sync": "step"},
        "zero3": {"zero_stage": 3}, "zero3_step": {"zero_stage": 3, "grad_sync": "step"}}.items()}
    blocks = make_model("llama").model.layers
    layers = 4 * sum(p.numel() for p in blocks.parameters()) / psi  # the decoder layers' share of Ψ
    # ZeRO-3: per micro-batch one reduce-scatter, every weight gathered for the forward and the layers again for
    # the backward (the root group, embedding, final norm and head, stays gathered in between)
    assert units == pytest.approx({"zero2": 5.0, "zero2_step": 2.0, "zero3": 4 * (2 + layers), "zero3_step": 2.0})
    held = {g: estimate(zero_stage=2, grad_sync=g).memory for g in ("micro_batch", "step")}
    assert held["step"]["grads"] == held["micro_batch"]["grads"]  # sharded between steps either way
    # every whole fp32 gradient held over the step, not one layer's waiting for its reduce-scatter
    layer = 4 * max(sum(p.numel() for p in block.parameters()) for block in blocks)
    assert held["step"]["other"] - held["micro_batch"]["other"] == psi - layer


def test_activations_match_what_autograd_saves_on_this_machine():
    """The activation formula (no recomputation, fp32) against the tensors autograd really keeps for backward in
    a forward pass of a small Llama: layers plus the loss's logits, within 5 %."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    mc = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mc, attn_implementation="sdpa")
    ids = torch.randint(0, 256, (2, 512))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(n for ptr, n in saved.items() if ptr not in weights)
    predicted = us.estimate(us.ParallelConfig(dp_shard=1), mc, world_size=1, seq_len=512,
                            micro_batch=2).memory["activations"]
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


@pytest.mark.parametrize("tp, recompute", [(1, "none"), (1, "full"), (2, "selective")])
def test_expert_parallel_prices_its_all_to_all(tp, recompute):
    """ep=2: per MoE layer and micro-batch, dispatch and combine in the forward and again in the backward (and in a
    recomputed forward), each handed tokens x top_k x hidden x activation bytes over "ep" (the planner's time counts
    the (ep-1)/ep of them that leave the rank); the tokens are this rank's (tensor parallel ranks hold the same ones and each send a slice). ep=1 moves nothing."""
    mc = make_config("qwen3_moe")  # 2 layers, 8 experts, top-2, hidden 64
    seq, mbs, ep = 32, 2, 2

    def est(**kw):
        cfg = us.ParallelConfig(dp_shard=4 // tp, tp=tp, zero_stage=3, activation_checkpointing=recompute,
                                mixed_precision="bf16", **kw)
        return us.estimate(cfg, mc, world_size=4, seq_len=seq, micro_batch=mbs, micro_batches=3)

    with_ep, without = est(ep=ep), est()
    (term,) = [t for t in with_ep.terms if t.axis == "ep"]
    passes = 4 + (2 if recompute != "none" else 0)
    tokens = seq * mbs // tp
    assert term.collective == "all_to_all" and term.per == "micro_batch"
    assert term.nbytes == pytest.approx(mc.num_hidden_layers * passes * tokens * 2 * 64 * 2)  # handed to it
    assert with_ep.comm["ep"] == pytest.approx(3 * term.nbytes)  # three micro-batches per step
    assert not [t for t in without.terms if t.axis == "ep"] and "ep" not in without.comm
    assert with_ep.factors["expert_matmul_gflop"] > 0  # each local expert sees ep ranks' rows


@pytest.mark.parametrize("world", [2])  # 4 and 8 (ZeRO-2 x TP + SP, ZeRO-1 x PP, ZeRO-3 x TP + SP x PP): in
#                                        benchmarks/own_memory.py, which runs every case; results committed
def test_the_estimate_is_within_ten_percent_of_the_measured_peak(world, tmp_path):
    """The per-rank estimate that the pre-launch check and ``layout: auto`` rely on (``Estimate.total_memory``:
    the backward's categories at once, or the optimizer step's memory if larger) against the real peak of a whole
    training step (gradient accumulation, clipping, foreach AdamW), measured per rank by tests/memory_worker.py
    with its storage ledger and torch's MemTracker: the 2-process layouts (ZeRO-3, DDP with
    recomputation, bf16) here; the 4- and 8-process ones in benchmarks/own_memory.py, which runs all (docs/planner.md
    has the table)."""
    import json

    from conftest import TESTS, torchrun
    from memory_worker import CASES

    names = [n for n, spec in CASES.items() if spec["world"] == world and spec.get("ci", True)]
    out = tmp_path / "memory.json"
    proc = torchrun(world, str(TESTS / "memory_worker.py"), str(out), *names, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = json.loads(out.read_text())["cases"]
    for name in names:
        for r in cases[name]["ranks"]:
            measured, predicted = r["ledger"]["peak"], r["estimate"]["total"]
            assert abs(predicted - measured) <= 0.10 * measured, (name, r["coords"], measured, predicted)
            if not r["ddp_bucket_bytes"]:  # torch's MemTracker agrees, where nothing only C++ holds (DDP's buckets)
                tracked = r["memtracker"]["peak"]
                assert abs(tracked - measured) <= 0.02 * measured, (name, r["coords"], measured, tracked)


def test_an_unknown_memory_profile_is_refused_naming_the_known_ones():
    """A profile no plugin prices is one line naming the value and the profiles there are, before any costing
    (each data-parallel plugin holds one function per profile)."""
    from transformers import LlamaConfig

    import ultrascale_plugins as us

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    with pytest.raises(us.ConfigError, match=r"^profile='deepspeed': .*Fix: one of ultrascale, nanotron"):
        us.estimate(us.ParallelConfig(), config, world_size=1, seq_len=64, profile="deepspeed")

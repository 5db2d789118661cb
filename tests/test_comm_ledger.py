"""The communication ledger (``comm_ledger``, ``comm_report``, ``ParallelModel.profile_step``): payload and wire
bytes of each collective, the layout's minimum (``ultrascale_cost_comm_minimum``), and one launch of the ledger benchmark
(benchmarks/comm_ledger.py) whose counts are facts of the layout, checked against torch's flight recorder."""
import json
from pathlib import Path

import pytest

import ultrascale_plugins as us
from conftest import torchrun
from models import make_config, make_model
from ultrascale_plugins.distributed.comm_ledger import SMALL_BYTES, CommRecord, records_of, summarise, wire_bytes
from ultrascale_plugins.core.comm_report import merge_rows, minimum_terms
from ultrascale_plugins.core.engine import estimate_with_shape

ROOT = Path(__file__).resolve().parent.parent


class Group:
    """What ``records_of`` asks of a process group."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_wire_bytes_are_the_ring_algorithms():
    assert wire_bytes("all_reduce", 1000, 4) == 1500  # 2(n-1)/n
    assert wire_bytes("all_gather", 1000, 4) == 750 and wire_bytes("reduce_scatter", 1000, 4) == 750
    assert wire_bytes("all_to_all", 1000, 4) == 750 and wire_bytes("all_to_all", 1000, 4, own=100) == 900
    assert wire_bytes("broadcast", 1000, 2) == 500
    assert wire_bytes("send", 1000, 2) == 1000 and wire_bytes("recv", 1000, 2) == 0
    assert wire_bytes("all_reduce", 1000, 1) == 0  # a group of one sends nothing


def test_payload_is_the_whole_tensor_the_collective_is_about():
    import torch

    label = lambda group: "tp"  # noqa: E731
    x = torch.zeros(4, 8)  # 128 bytes
    # a functional all-gather is handed one rank's part: the payload is the gathered whole
    (ag,) = records_of("_c10d_functional.all_gather_into_tensor", {"input": x, "group_size": 2,
                                                                   "group_name": Group(2)}, label)
    assert (ag.op, ag.axis, ag.payload, ag.wire) == ("all_gather", "tp", 256, 128)
    # c10d's reduce-scatter is handed the whole input
    (rs,) = records_of("c10d._reduce_scatter_base_", {"input_tensor": x, "output_tensor": x[:2],
                                                      "process_group": Group(2)}, label)
    assert (rs.op, rs.payload, rs.wire) == ("reduce_scatter", 128, 64)
    (ar,) = records_of("c10d.allreduce_", {"tensors": [x], "process_group": Group(4)}, label)
    assert (ar.payload, ar.wire) == (128, 192)
    # an all-to-all with uneven splits: the rank's own rows stay
    (a2a,) = records_of("_c10d_functional.all_to_all_single", {"input": x, "input_split_sizes": [1, 3],
                                                              "group_name": Group(2, rank=1)}, label)
    assert (a2a.payload, a2a.wire) == (128, 32)
    sends = records_of("_c10d_functional.batch_p2p_ops", {"op_list": ["isend", "irecv"], "tensors": [x, x],
                                                          "group_name": Group(2)}, label)
    assert [(r.op, r.payload, r.wire) for r in sends] == [("send", 128, 128), ("recv", 128, 0)]
    assert records_of("aten.mm", {}, label) == []


def test_scalar_exchanges_are_rows_of_their_own():
    rows = summarise([CommRecord("all_reduce", "dp_shard", 2, 8, 8.0), CommRecord("all_reduce", "dp_shard", 2, 8, 8.0),
                      CommRecord("all_reduce", "dp_shard", 2, 4096, 4096.0)])
    assert [(r["small"], r["calls"], r["payload"]) for r in rows] == [(True, 2, 16), (False, 1, 4096)]
    assert SMALL_BYTES <= 4096


def test_rows_are_the_most_loaded_rank_beside_the_estimate_and_minimum():
    kb = 10_000

    def rec(axis, op, calls, payload, rank):
        return {"axis": axis, "op": op, "small": False, "calls": calls, "payload": payload * kb, "wire": 0.0,
                "rank": rank}

    measured = [rec("pp", "send", 8, 8, 0), rec("pp", "recv", 8, 8, 0), rec("pp", "send", 16, 16, 1),
                rec("dp_shard|ep", "all_to_all", 4, 40, 0)]
    rows = merge_rows(measured, [("pp", "p2p", 16, 15 * kb, 0), ("ep", "all_to_all", 4, 30 * kb, 0)],
                      [("pp", "p2p", 16, 16 * kb, 8 * kb), ("ep", "all_to_all", 4, 40 * kb, 20 * kb)])
    by = {(r["axis"], r["op"]): r for r in rows}
    # a pipeline's sends and receives are one row (the estimate counts both ends), the most loaded rank's
    assert by["pp", "p2p"]["payload"] == 16 * kb and by["pp", "p2p"]["ranks"] == {0: 16 * kb, 1: 16 * kb}
    assert by["pp", "p2p"]["estimate"] == {"calls": 16, "payload": 15 * kb, "wire": 0}
    # a group that is two axes at once (ep over dp_shard's ranks): the estimate's "ep" is that row
    assert by["dp_shard|ep", "all_to_all"]["minimum"] == {"calls": 4, "payload": 40 * kb, "wire": 20 * kb}
    assert ("ep", "all_to_all") not in by


def _minimum(layout: dict, world: int, **step) -> dict:
    mc = make_config("llama")
    config = us.ParallelConfig(**layout)
    resolved = us.validate(config, mc, world)
    _, shape = estimate_with_shape(resolved, mc, world_size=world, check=False, **step)
    out: dict = {}
    for t in minimum_terms(resolved, shape, us.get_plugin_manager()):
        calls, payload = out.get((t.axis, t.op), (0, 0))
        out[t.axis, t.op] = (calls + t.calls, payload + t.payload)
    return out


def test_minimum_is_the_playbooks_formulas():
    psi = 4 * sum(p.numel() for p in make_model("llama").parameters())  # fp32 bytes of the model
    act = 2 * 32 * 64 * 4  # b·s·h of one micro-batch, fp32
    step = {"seq_len": 32, "micro_batch": 2}
    # tensor parallel (Megatron): 2 forward + 2 backward all-reduces per layer, + the head's input gradient and the
    # vocabulary-parallel embedding's output; the logits gathered for the loss (vocabulary 256 = 4 h), or with
    # loss_parallel 3 scalar reductions in their place
    tp = _minimum({"tp": 2, "dp_shard": 1}, 2, **step)
    assert tp["tp", "all_reduce"] == (10, 10 * act) and tp["tp", "all_gather"] == (1, 4 * act)
    assert _minimum({"tp": 2, "dp_shard": 1, "loss_parallel": True}, 2, **step)["tp", "all_reduce"][0] == 10 + 3
    sp = _minimum({"tp": 2, "sequence_parallel": True, "dp_shard": 1}, 2, **step)
    assert sp["tp", "all_gather"] == (10 + 1, (10 + 4) * act) and sp["tp", "reduce_scatter"] == (10, 10 * act)
    # a tied embedding is vocabulary-parallel like an untied one: its output reduced (scattered under SP)
    tied = us.validate(us.ParallelConfig(tp=2, sequence_parallel=True, dp_shard=1), make_config("llama_tied"), 2)
    _, shape = estimate_with_shape(tied, make_config("llama_tied"), world_size=2, check=False, **step)
    calls = {}
    for t in minimum_terms(tied, shape, us.get_plugin_manager()):
        calls[t.op] = calls.get(t.op, 0) + t.calls
    assert calls == {"all_gather": 10 + 1, "reduce_scatter": 10}
    # ZeRO: gradients reduce-scattered once (ZeRO-1) or every micro-batch (ZeRO-2/3); weights gathered once a
    # step (ZeRO-1/2) or for each forward and backward (ZeRO-3)
    for zero, rs, ag in ((1, (1, psi), (1, psi)), (2, (4, 4 * psi), (1, psi)), (3, (4, 4 * psi), (8, 8 * psi))):
        terms = _minimum({"dp_shard": 2, "zero_stage": zero}, 2, micro_batches=4, **step)
        assert terms["dp_shard", "reduce_scatter"] == rs and terms["dp_shard", "all_gather"] == ag, zero
    # grad_sync: step reduces once per step and keeps ZeRO-3's weights gathered over it
    terms = _minimum({"dp_shard": 2, "zero_stage": 3, "grad_sync": "step"}, 2, micro_batches=4, **step)
    assert terms["dp_shard", "reduce_scatter"] == (1, psi) and terms["dp_shard", "all_gather"] == (1, psi)
    assert _minimum({"dp_shard": 2, "zero_stage": 0}, 2, **step)["dp_shard", "all_reduce"] == (1, psi)
    # a pipeline: each micro-batch's activation forward and its gradient back, at both ends of the boundary
    pp = _minimum({"pp": 2, "dp_shard": 1, "pp_microbatches": 8}, 2, micro_batches=8, **step)
    assert pp["pp", "p2p"] == (16, 16 * act)


LAUNCHED = ("zero3_m1", "zero2_m4", "tp2", "tp2_sp", "cp2_ring", "cp2_ulysses", "ep2")


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    out = tmp_path_factory.mktemp("ledger") / "ledger.json"
    proc = torchrun(2, str(ROOT / "benchmarks" / "comm_ledger.py"), "--worker", str(out), *LAUNCHED, timeout=300,
                    env={"TORCH_FR_BUFFER_SIZE": "20000"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = {r["name"]: r for r in json.loads(out.read_text())}
    return {name: (r, {(row["axis"], row["op"]): row for row in r["rows"] if not row["small"]})
            for name, r in results.items()}


@pytest.mark.slow
def test_the_ledger_counts_the_layouts_collectives(ledger):
    model = make_model("llama")
    psi = 4 * sum(p.numel() for p in model.parameters())
    layers = 4 * sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    groups = model.config.num_hidden_layers + 1  # FSDP2: one group per decoder layer, and the root
    for name, (result, _) in ledger.items():  # torch's flight recorder counts the same calls on every axis
        assert result["flight_recorder"]["on"] and result["flight_recorder"]["differ"] == {}, name
    # ZeRO-3, one micro-batch: each group's gradients reduce-scattered once, the whole model's fp32 bytes; every
    # group gathered for the forward, every layer again for the backward (the root stays gathered)
    _, rows = ledger["zero3_m1"]
    assert {axis for axis, _ in rows} == {"dp_shard"}
    assert (rows["dp_shard", "reduce_scatter"]["calls"], rows["dp_shard", "reduce_scatter"]["payload"]) == (groups, psi)
    assert (rows["dp_shard", "all_gather"]["calls"], rows["dp_shard", "all_gather"]["payload"]) == \
        (2 * groups - 1, psi + layers)
    assert rows["dp_shard", "reduce_scatter"]["minimum"]["payload"] == psi
    # ZeRO-2 keeps gradients sharded across the window: reduce-scattered after each of the 4 micro-batches; the
    # weights stay gathered over it: each group gathered once per step, the minimum
    _, rows = ledger["zero2_m4"]
    assert (rows["dp_shard", "reduce_scatter"]["calls"], rows["dp_shard", "reduce_scatter"]["payload"]) == \
        (4 * groups, 4 * psi)
    assert (rows["dp_shard", "all_gather"]["calls"], rows["dp_shard", "all_gather"]["payload"]) == (groups, psi)
    assert rows["dp_shard", "all_gather"]["minimum"]["payload"] == psi
    # tensor parallel: Megatron's count, one reduction of each region's input and output, forward and backward,
    # and one per end: every collective on the tp axis, as many all-reduces as the minimum; under sequence
    # parallel no activation all-reduce at all, and the logits' gather besides (no loss_parallel here)
    layers = model.config.num_hidden_layers
    _, rows = ledger["tp2"]
    assert {axis for axis, _ in rows} == {"tp"}
    assert rows["tp", "all_reduce"]["calls"] == rows["tp", "all_reduce"]["minimum"]["calls"] == 4 * layers + 2
    _, rows = ledger["tp2_sp"]
    assert ("tp", "all_reduce") not in rows, rows.get(("tp", "all_reduce"))
    assert rows["tp", "reduce_scatter"]["calls"] == rows["tp", "reduce_scatter"]["minimum"]["calls"] == 4 * layers + 2
    assert rows["tp", "all_gather"]["calls"] == rows["tp", "all_gather"]["minimum"]["calls"] == 4 * layers + 3


@pytest.mark.slow
def test_the_estimate_is_what_runs_for_data_tensor_and_context_parallel(ledger):
    """The package's estimate of each collective (what the planner ranks layouts by) is within 10 % of the bytes
    measured, for ZeRO-2/3 with 1 and 4 micro-batches (the root group stays gathered for the backward), both
    context-parallel methods (the ring's hops and their fp32 gradients, Ulysses' whole tensors, the gradients'
    all-reduce over cp, which was missing) and expert parallel (the experts' shards and their collectives on their
    own axis, none here where efsdp is 1; the all-to-alls' bytes as handed to them) and tensor parallel with and
    without sequence parallel (each region's reductions as the trace sets them up, the ends, the logits)."""
    for name in ("zero3_m1", "zero2_m4", "tp2", "tp2_sp", "cp2_ring", "cp2_ulysses", "ep2"):
        _, rows = ledger[name]
        for (axis, op), row in rows.items():
            measured, estimate = row["payload"], (row["estimate"] or {}).get("payload")
            assert estimate is not None and abs(estimate - measured) <= 0.10 * measured, (name, axis, op, row)
    _, rows = ledger["cp2_ring"]
    assert rows["cp", "all_reduce"]["calls"] == 1 and rows["cp", "all_reduce"]["estimate"]["calls"] == 1

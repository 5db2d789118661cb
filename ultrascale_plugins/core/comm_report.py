"""One optimizer step's communication, every rank's ledger (``comm_ledger``) set out per mesh axis and collective
beside what the package's estimate says the same step sends (``costing``'s communication terms) and what the
layout needs at least (``minimum_terms``: every plugin's ``ultrascale_cost_comm_minimum``). ``ParallelModel.profile_step``
fills a ``StepProfile``.

The rows are the most loaded rank's: for each axis and collective, the rank that sent the most payload (a pipeline's
middle stages send more than its ends), as the estimate prices the most loaded rank along every axis. Scalar
exchanges (each call under ``comm_ledger.SMALL_BYTES``: token counts, the loss, a norm) cost latency, not bandwidth:
they get rows of their own, marked ``small``, so that they do not blur the bytes.
"""
from __future__ import annotations

import contextlib
import math

import torch.distributed as dist

from ..distributed.comm_ledger import (SMALL_BYTES, CommLedger, GroupLabels, flight_recorder_check, last_record_id,
                                       summarise, wire_bytes)
from ..interface.comm_minimum import MinimumTerm
from .costing import resolved_cost

P2P = ("send", "recv")  # one row: the estimate and the minimum count a pipeline's transfers at both ends


def _key(axis: str, op: str, small: bool) -> tuple:
    return axis, "p2p" if op in P2P else op, small


class StepProfile:
    """What ``ParallelModel.profile_step`` yields. ``rows``: one dict per (axis, collective, small) with the
    measured ``calls``, ``payload`` and ``wire`` bytes, the ``estimate`` and the ``minimum`` (each ``{"calls",
    "payload", "wire"}``, or None where it has no term), and ``ranks`` (every rank's payload); ``table``: the rows
    as text; ``flight_recorder``: the flight recorder's count beside this rank's ledger (``{"on": False}`` when it
    is off); ``step``: the shape of the step that was recorded. All are filled when the block ends."""

    def __init__(self, pmodel):
        self.pmodel = pmodel
        self.batches: list[tuple[int, int]] = []  # (rows, sequence) of each batch the step prepared
        self.rows: list[dict] = []
        self.table = ""
        self.flight_recorder: dict = {}
        self.step: dict = {}

    def saw_batch(self, batch: dict) -> None:
        rows, seq = batch["input_ids"].shape[:2]
        self.batches.append((int(rows), int(seq)))

    def finish(self, records, labels, after: int, out) -> None:
        self.flight_recorder = flight_recorder_check(records, after, labels)
        mine = [dict(r, rank=dist.get_rank()) for r in summarise(records)]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        self.step = step_shape(self.pmodel.tokens.microbatches_inside, self.batches)
        estimate, minimum = expected(self.pmodel, self.step) if self.step else ([], [])
        self.rows = merge_rows([r for rank_rows in every for r in rank_rows], estimate, minimum)
        self.table = format_table(self.rows, self.pmodel.dims.describe(), self.step)
        if out is not None and dist.get_rank() == 0:
            out(self.table)


@contextlib.contextmanager
def record_step(pmodel, out=print):
    """``ParallelModel.profile_step``: record every collective this rank issues inside the block (a ledger over
    the layout's meshes and its views'), then fill the ``StepProfile`` it yields from every rank's record."""
    profile = StepProfile(pmodel)
    labels = GroupLabels(lambda: [pmodel.dims.mesh, *pmodel.dims.view_meshes.values()])
    after = last_record_id()  # the flight recorder's last entry, when it is on (the independent count)
    pmodel.recording = profile
    try:
        with CommLedger(labels) as ledger:
            yield profile
    finally:
        pmodel.recording = None
    profile.finish(ledger.records, labels, after, out)


def step_shape(pieces: int, batches: list[tuple[int, int]]) -> dict:
    """The estimate's arguments for the recorded step: micro-batches, rows per micro-batch, sequence. The model
    splits each batch it is handed into ``pieces`` micro-batches (a pipeline's schedule; 1 otherwise)."""
    if not batches:
        return {}
    rows, seq = batches[0]
    return {"micro_batches": len(batches) * pieces, "micro_batch": max(1, rows // pieces), "seq_len": seq}


def expected(pmodel, step: dict) -> tuple[list[tuple], list[tuple]]:
    """The estimate's and the minimum's terms for this step, as (axis, op, calls, payload, wire) per step, for the
    most loaded rank (no coordinates). Their wire bytes are the ring's for their payload (``wire_bytes``)."""
    model = pmodel.module
    resolved = pmodel.pm.resolve(pmodel.config, dist.get_world_size(), check=False)
    est, shape = resolved_cost(resolved, model.config, pm=pmodel.pm, model=_meta_model(model), **step)
    m = step["micro_batches"]
    size = lambda axis: math.prod(pmodel.dims.degree(a) for a in axis.split("+"))  # noqa: E731
    terms = [_with_wire(t.axis, t.collective, t.calls * (m if t.per == "micro_batch" else 1),
                        t.nbytes * (m if t.per == "micro_batch" else 1), size(t.axis)) for t in est.terms]
    return terms, [_with_wire(t.axis, t.op, t.calls, t.payload, size(t.axis))
                   for t in minimum_terms(pmodel.config, shape, pmodel.pm)]


def minimum_terms(config, shape, pm) -> list[MinimumTerm]:
    """The least communication the layout needs for one step on the rank ``shape`` describes, once every
    dimension's ``ultrascale_cost_estimate`` has cut its inventory: every plugin's ``ultrascale_cost_comm_minimum`` terms
    (an axis no plugin answers for has none), those with calls, in one order whatever the plugins' order."""
    terms = [t for answer in pm.hook.ultrascale_cost_comm_minimum(config=config, shape=shape) for t in answer or ()]
    return sorted((t for t in terms if t.calls > 0), key=lambda t: (t.axis, t.op))


def _with_wire(axis: str, op: str, calls: int, payload: float, size: int) -> tuple:
    # "p2p" counts both ends of each transfer in its payload; the wire, the sends
    wire = payload / 2 if op == "p2p" else wire_bytes(op, payload, size)
    return axis, op, calls, payload, wire


def _meta_model(model):
    """The model on the meta device for the estimate's inventory: a PEFT model's tree as it is (its adapters are
    part of it), any other rebuilt from its config."""
    from ..interface.estimates import meta_model

    if hasattr(model, "peft_config"):
        from ..interface.meta_copy import meta_copy

        return meta_copy(model)
    return meta_model(model.config)


def merge_rows(measured: list[dict], estimate: list[tuple], minimum: list[tuple]) -> list[dict]:
    """One row per (axis, op, small): the most loaded rank's measured figures beside the estimate and the minimum.
    ``measured``: ``comm_ledger.summarise`` rows of every rank, each with its ``rank``."""
    per_rank: dict[tuple, dict[int, dict]] = {}
    for r in measured:
        slot = per_rank.setdefault(_key(r["axis"], r["op"], r["small"]), {}).setdefault(
            r["rank"], {"calls": 0, "payload": 0, "wire": 0.0})
        for k in ("calls", "payload", "wire"):
            slot[k] += r[k]
    rows: dict[tuple, dict] = {}
    for key, ranks in per_rank.items():
        top = max(ranks.values(), key=lambda v: (v["payload"], v["calls"]))
        rows[key] = {"axis": key[0], "op": key[1], "small": key[2], **top, "estimate": None, "minimum": None,
                     "ranks": {rank: v["payload"] for rank, v in sorted(ranks.items())}}
    for field, terms in (("estimate", estimate), ("minimum", minimum)):
        for axis, op, calls, payload, wire in terms:
            key = (_measured_axis(axis, per_rank), op, calls > 0 and payload / calls < SMALL_BYTES)
            row = rows.setdefault(key, {"axis": axis, "op": op, "small": key[2], "calls": 0, "payload": 0,
                                        "wire": 0.0, "estimate": None, "minimum": None, "ranks": {}})
            row[field] = row[field] or {"calls": 0, "payload": 0.0, "wire": 0.0}
            row[field]["calls"] += calls
            row[field]["payload"] += payload
            row[field]["wire"] += wire
    return sorted(rows.values(), key=lambda r: (r["small"], r["axis"], r["op"]))


def axis_totals(rows: list[dict], least: int = 2) -> list[dict]:
    """Per axis of ``least`` bytes rows or more, their sum (op "total"): where the layout runs other collectives
    than the minimum (ZeRO-1 as DDP's all-reduce and a broadcast of the updated shards, not a reduce-scatter and an
    all-gather), the axis's totals still compare."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["axis"]] = counts.get(r["axis"], 0) + (not r["small"])
    rows = [r for r in rows if counts[r["axis"]] >= least]
    out: dict[str, dict] = {}
    for r in rows:
        if r["small"]:
            continue
        total = out.setdefault(r["axis"], {"axis": r["axis"], "op": "total", "small": False, "calls": 0, "payload": 0,
                                           "wire": 0.0, "estimate": None, "minimum": None, "ranks": {}})
        for k in ("calls", "payload", "wire"):
            total[k] += r[k]
        for field in ("estimate", "minimum"):
            if r[field]:
                total[field] = total[field] or {"calls": 0, "payload": 0.0, "wire": 0.0}
                for k in ("calls", "payload", "wire"):
                    total[field][k] += r[field][k]
    return list(out.values())


def _measured_axis(axis: str, measured: dict) -> str:
    """The ledger's name for an axis of the estimate: a process group that is two axes at once (ep over the same
    ranks as dp_shard) is named "dp_shard|ep" by the ledger."""
    for label, _, _ in measured:
        if axis in label.split("|"):
            return label
    return axis


def human(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def format_table(rows: list[dict], layout: str, step: dict) -> str:
    """The rows as text: bytes rows, then the scalar exchanges."""
    shape = (f"{step['micro_batches']} micro-batch(es) of {step['micro_batch']} x {step['seq_len']} tokens"
             if step else "no batch seen: no estimate")
    head = (f"{'axis':<14}{'op':<16}{'calls':>6}{'payload':>12}{'wire':>12}{'estimate':>12}{'minimum':>12}"
            f"{'meas/min':>10}{'wire/min':>10}{'est/meas':>10}")
    lines = [f"communication of one optimizer step, layout {layout}, {shape} (bytes per rank; each row the most "
             "loaded rank's; meas/min: payload measured / minimum, wire/min: the same of wire bytes, est/meas: the "
             "estimate's payload / measured)", head]
    for r in [r for r in rows if not r["small"]] + axis_totals(rows):
        est, low = r["estimate"] or {}, r["minimum"] or {}
        lines.append(f"{r['axis']:<14}{r['op']:<16}{r['calls']:>6}{human(r['payload']):>12}{human(r['wire']):>12}"
                     f"{human(est['payload']) if est else '-':>12}{human(low['payload']) if low else '-':>12}"
                     f"{ratio(r['payload'], low.get('payload')):>10}{ratio(r['wire'], low.get('wire')):>10}"
                     f"{ratio(est.get('payload'), r['payload']):>10}")
    small = [r for r in rows if r["small"]]
    if small:
        lines.append(f"scalar exchanges (under {SMALL_BYTES} bytes a call: token counts, loss, norms):")
        lines += [f"{r['axis']:<14}{r['op']:<16}{r['calls']:>6}{human(r['payload']):>12}"
                  f"{'  minimum ' + str(r['minimum']['calls']) + ' calls' if r['minimum'] else ''}" for r in small]
    return "\n".join(lines)

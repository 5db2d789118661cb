"""A pipeline schedule as a timeline, for the planner's plot (``PipelineSchedule.timeline``, the pipeline's answer to
``ultrascale_cost_schedule``).

Each schedule is an order of actions per pipeline rank, and the start
of every action is found by list scheduling, i.e. as soon as its rank is free and the action it waits for
(the previous stage's forward, the next stage's backward) has finished. Communication takes no time. Time is
counted in units of one forward of one micro-batch on one stage; a backward takes 2 units, or, for zero-bubble
schedules, B (input gradient) 1 unit and W (weight gradient) 1 unit. The orders:

- ``gpipe``: all forwards, then all backwards.
- ``1f1b``: ``p - rank - 1`` warm-up forwards, then one forward / one backward, then the remaining backwards.
- ``interleaved_1f1b``: Megatron's interleaved order as torch's ``ScheduleInterleaved1F1B`` builds it (chunks
  of a rank take turns per round of micro-batches; warm-up grows by 2 per hop from the last rank). When the
  micro-batches do not split into equal rounds the last round is shorter, where torch refuses the schedule.
- ``zero_bubble``: ZB-H1, the same order with backward split into B and W and each rank's W lagging its B by
  ``rank`` backwards (torch's ``ScheduleInterleavedZeroBubble``; with v > 1 it is interleaved likewise).
- ``zbv``: the V-shaped order of torch's ``ScheduleZBVZeroBubble`` (rank r holds stages r and 2p - 1 - r).
- ``dualpipev``: approximated by the ``zbv`` order. DualPipeV runs one micro-batch's forward and another's
  backward at the same time on a rank, which a one-thing-at-a-time timeline cannot show.
"""
from __future__ import annotations

import dataclasses
import math

from ...interface.step_schedule import StepSchedule
from .split import LOOPED, SINGLE_STAGE, V_SHAPED


def chunks_per_rank(schedule: str, v: int) -> int:
    if schedule in V_SHAPED:
        return 2
    return v if schedule in LOOPED else 1


def _stage(schedule: str, p: int, rank: int, chunk: int) -> int:
    if schedule in V_SHAPED:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def _waits_for(kind: str, mb: int, stage: int, n_stages: int) -> tuple:
    """The action (kind, micro-batch, stage) that must finish before this one may start."""
    if kind == "F":
        return ("F", mb, stage - 1) if stage > 0 else ()
    if kind == "B":
        return ("B", mb, stage + 1) if stage < n_stages - 1 else ("F", mb, stage)
    return ("B", mb, stage)


def _one_f_one_b(p: int, m: int, v: int, rank: int, warmup_per_hop: int) -> list:
    """(kind, micro-batch, chunk) in the (interleaved) 1F1B order of one rank; v = 1 is plain 1F1B."""
    rounds = max(1, m // p)
    per_round = math.ceil(m / rounds)
    forwards, backwards = [], []
    for first in range(0, m, per_round):
        batch = range(first, min(first + per_round, m))
        forwards += [(mb, c) for c in range(v) for mb in batch]
        backwards += [(mb, c) for c in reversed(range(v)) for mb in batch]
    # enough forwards in flight that the first backward finds this rank free (torch's _get_warmup_ops)
    warmup = min(len(forwards), (v - 1) * per_round + warmup_per_hop * (p - 1 - rank))
    order = [("F", *f) for f in forwards[:warmup]]
    for f, b in zip(forwards[warmup:], backwards):
        order += [("F", *f), ("B", *b)]
    return order + [("B", *b) for b in backwards[len(forwards) - warmup:]]


def _split_backward(order: list, lag: int) -> list:
    """Each backward becomes B then, ``lag`` backwards later, its W (the rest at the end)."""
    out, pending = [], []
    for action in order:
        out.append(action)
        if action[0] == "B":
            pending.append(("W", *action[1:]))
            if len(pending) > lag:
                out.append(pending.pop(0))
    return out + pending


def _v_shape(p: int, m: int, rank: int) -> list:
    """torch's ScheduleZBVZeroBubble order for one rank (chunk 0 = stage rank, chunk 1 = stage 2p - 1 - rank)."""
    n = max(2 * p - 1, m)  # the order needs that many micro-batches; the extra ones are dropped at the end
    order, count = [], {(kind, chunk): 0 for kind in "FBW" for chunk in (0, 1)}

    def run(*actions):  # "F0": chunk 0's forward of the next micro-batch it has not run yet
        for kind, chunk in actions:
            key = (kind, int(chunk))
            order.append((kind, count[key], int(chunk)))
            count[key] += 1

    for _ in range(2 * (p - rank) - 1):
        run("F0")
    for _ in range(rank):
        run("F1", "F0")
    for _ in range(p - rank):
        run("F1", "B1", "W1")
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        if count["F", 0] < n:
            run("F0")
        run("B0", "W0", "F1", "B1", "W1")
    for _ in range(rank):
        run("B0", "B1")
    for _ in range(p - rank):
        run("B0", "W0")
    run(*["W1"] * (count["B", 1] - count["W", 1]), *["W0"] * (count["B", 0] - count["W", 0]))
    return [action for action in order if action[1] < m]


def rank_order(schedule: str, p: int, m: int, v: int, rank: int) -> list:
    """The actions (kind, micro-batch, chunk) of pipeline rank ``rank``, in the order it runs them."""
    if schedule == "gpipe":
        return [("F", mb, 0) for mb in range(m)] + [("B", mb, 0) for mb in range(m)]
    if schedule == "1f1b":
        return _one_f_one_b(p, m, 1, rank, 1)
    if schedule == "interleaved_1f1b":
        return _one_f_one_b(p, m, v, rank, 2 if v > 1 else 1)
    if schedule == "zero_bubble":
        return _split_backward(_one_f_one_b(p, m, v, rank, 1), lag=rank)
    if schedule in V_SHAPED:
        return _v_shape(p, m, rank)
    known = sorted({**SINGLE_STAGE, **LOOPED, **V_SHAPED})
    raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(known)}")


def schedule_timeline(schedule: str, p: int, m: int, v: int = 1) -> list[list[tuple]]:
    """Per pipeline rank, its actions as (start, end, kind, micro-batch, chunk), kind in F / B / W, in time units
    of one forward of one micro-batch on one stage. ``v`` counts for looped schedules only (V-shaped ones hold 2
    chunks per rank, the others 1)."""
    if p < 1 or m < 1:
        raise ValueError(f"a pipeline needs p >= 1 ranks and m >= 1 micro-batches, got p={p}, m={m}")
    v = chunks_per_rank(schedule, v)
    orders = [rank_order(schedule, p, m, v, rank) for rank in range(p)]
    split = any(kind == "W" for order in orders for kind, _, _ in order)
    duration = {"F": 1, "B": 1 if split else 2, "W": 1}
    n_stages = p * v
    finished: dict = {}
    free = [0] * p
    timeline: list[list[tuple]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            order = orders[rank]
            while len(timeline[rank]) < len(order):
                kind, mb, chunk = order[len(timeline[rank])]
                stage = _stage(schedule, p, rank, chunk)
                dep = _waits_for(kind, mb, stage, n_stages)
                if dep and dep not in finished:
                    break  # another rank has to get further first
                start = max(free[rank], finished[dep] if dep else 0)
                free[rank] = finished[(kind, mb, stage)] = start + duration[kind]
                timeline[rank].append((start, free[rank], kind, mb, chunk))
                progress = True
    if any(len(timeline[r]) < len(orders[r]) for r in range(p)):
        raise RuntimeError(f"the {schedule} order deadlocks for p={p}, m={m}, v={v}")  # a bug in an order above
    return timeline


@dataclasses.dataclass(frozen=True)
class PipelineSchedule(StepSchedule):
    """A pipeline's step (``ultrascale_cost_schedule``): ``schedule`` over ``stages`` ranks, ``virtual_stages`` per
    rank where it loops, its timeline simulated above."""

    schedule: str = "1f1b"
    stages: int = 1
    virtual_stages: int = 1
    holds: dict = dataclasses.field(default_factory=dict, compare=False)  # {pp rank: its stage ids}, for ``role``

    def role(self, coords: dict[str, int]) -> str:
        """"first pipeline rank (0): stage 0, the embedding", "middle ... (1): stage 1", "last ... (3): stage 3, the
        head": where the rank sits, the stages it holds and the ends among them."""
        rank = coords.get("pp", 0)
        ids = self.holds.get(rank, ())
        last = max((s for held in self.holds.values() for s in held), default=-1)
        where = "first" if rank == 0 else "last" if rank == self.stages - 1 else "middle"
        ends = [what for stage, what in ((0, "the embedding"), (last, "the head")) if stage in ids]
        held = f"stage{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
        return f"{where} pipeline rank ({rank}): {', '.join([held, *ends])}"

    def timeline(self, microbatches: int) -> list[list[tuple]]:
        return schedule_timeline(self.schedule, self.stages, microbatches, self.virtual_stages)

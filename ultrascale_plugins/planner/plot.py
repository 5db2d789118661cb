"""The figure of ``ultrascale plan --plot out.png``: per-GPU memory of the top layouts, and the chosen layout's
pipeline schedule as a timeline (ranks x time, forward / backward / idle), drawn the way the Ultra-Scale Playbook
draws them.

The timeline comes from a small simulator: each schedule is an order of actions per pipeline rank, and the start
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

import math

from ..config import ConfigError
from ..dims.pipeline_split import LOOPED, SINGLE_STAGE, V_SHAPED

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "other")
MEMORY_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c")
KIND_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
MAX_DRAWN_MICROBATCHES = 16


# ---- the schedule simulator ----------------------------------------------------------------------------------

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


def idle_fraction(timeline: list[list[tuple]], rank: int = 0) -> float:
    """Idle share of ``rank``'s step, the step running from time 0 to the end of the last action of any rank."""
    total = max(row[-1][1] for row in timeline if row)
    busy = sum(end - start for start, end, *_ in timeline[rank])
    return (total - busy) / total if total else 0.0


# ---- the figure --------------------------------------------------------------------------------------------------

def _figure_class():
    try:
        import matplotlib  # noqa: F401 - imported first so that a missing package fails here, not halfway
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ConfigError("--plot needs matplotlib, which is not installed. "
                          "Fix: pip install 'ultrascale-plugins[plot]'") from err
    return Figure


def short_label(layout) -> str:
    """Degrees on the first line, then ZeRO stage and batch split, then recomputation and schedule if any."""
    lines = [" ".join([f"dp{layout.dp}", f"tp{layout.tp}", f"pp{layout.pp}"] + ([f"cp{layout.cp}"] if layout.cp > 1
                                                                             else [])),
             f"z{layout.zero_stage} mbs{layout.micro_batch_size} ga{layout.grad_accum}"]
    extra = [] if layout.activation_checkpointing == "none" else [f"rc-{layout.activation_checkpointing}"]
    if layout.pp > 1:
        v = chunks_per_rank(layout.pp_schedule, layout.pp_virtual_stages)
        extra.append(layout.pp_schedule + (f" v{v}" if layout.pp_schedule in LOOPED else ""))
    return "\n".join(lines + ([" ".join(extra)] if extra else []))


def _draw_memory(ax, results: list, best, memory_limit_gb: float) -> None:
    x = range(len(results))
    bottoms = [0.0] * len(results)
    for part, color in zip(MEMORY_PARTS, MEMORY_COLORS):
        heights = [r.memory_gb.get(part, 0.0) for r in results]
        bars = ax.bar(x, heights, bottom=bottoms, color=color, label=part, edgecolor="white", linewidth=0.5)
        for bar, result in zip(bars, results):
            if not result.fits:  # faded and hatched: a layout that runs out of memory
                bar.set_alpha(0.4)
                bar.set_hatch("//")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, result in enumerate(results):
        total = result.memory_gb.get("total", bottoms[i])
        chosen = result.layout == best.layout
        note = " (chosen)" if chosen else "" if result.fits else " (OOM)"
        ax.annotate(f"{total:.1f} GB{note}", (i, bottoms[i]), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=7, fontweight="bold" if chosen else "normal")
    ax.axhline(memory_limit_gb, color="black", linestyle="--", linewidth=1,
               label=f"GPU memory ({memory_limit_gb:g} GB)")
    ax.set_xticks(list(x), [short_label(r.layout) for r in results], fontsize=7)
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_xlim(-0.6, max(len(results), 4) - 0.4)  # a lone bar stays bar-sized
    ax.set_ylim(0, 1.15 * max(bottoms + [memory_limit_gb]))
    plural = "s" if len(results) > 1 else ""
    ax.set_title(f"Memory per GPU of the top {len(results)} layout{plural} (hatched: does not fit)")
    ax.legend(fontsize=7, ncol=3, loc="upper right")


def _shade(color: str, chunk: int, chunks: int) -> tuple:
    """Lighter for later chunks, so that the v chunks of a rank can be told apart."""
    from matplotlib.colors import to_rgb

    mix = 0.6 * chunk / max(1, chunks - 1) if chunks > 1 else 0.0
    return tuple(c + (1 - c) * mix for c in to_rgb(color))


def _draw_timeline(ax, best) -> None:
    from matplotlib.patches import Patch
    from matplotlib.transforms import offset_copy

    lay = best.layout
    p, m = lay.pp, lay.grad_accum
    schedule = lay.pp_schedule if p > 1 else "1f1b"
    v = chunks_per_rank(schedule, lay.pp_virtual_stages)
    drawn = min(m, max(MAX_DRAWN_MICROBATCHES, 2 * p))  # 2p: enough to reach the steady state
    timeline = schedule_timeline(schedule, p, drawn, v)
    total = max(row[-1][1] for row in timeline)
    fontsize = min(7.0, 450 / total)  # micro-batch numbers shrink with the boxes, and go when unreadable
    for rank, row in enumerate(timeline):
        ax.barh(rank, total, left=0, height=0.8, color="#eeeeee", edgecolor="#bbbbbb", linewidth=0.5)  # idle
        for start, end, kind, mb, chunk in row:
            ax.barh(rank, end - start, left=start, height=0.8, color=_shade(KIND_COLORS[kind], chunk, v),
                    edgecolor="white", linewidth=0.5)
            if fontsize >= 3:
                ax.text((start + end) / 2, rank, str(mb), ha="center", va="center", fontsize=fontsize)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, total)
    ax.set_xlabel("time (1 = forward of one micro-batch on one stage)")
    split = any(kind == "W" for row in timeline for _, _, kind, _, _ in row)
    names = {"F": "forward", "B": "backward (input grad)" if split else "backward", "W": "weight grad"}
    kinds = ("F", "B", "W") if split else ("F", "B")
    handles = [Patch(color=KIND_COLORS[k], label=names[k]) for k in kinds] + [Patch(color="#eeeeee", label="idle")]
    below_xlabel = offset_copy(ax.transAxes, fig=ax.figure, y=-36, units="points")
    ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="upper center", bbox_to_anchor=(0.5, 0.0),
              bbox_transform=below_xlabel)
    ax.set_title(_timeline_title(schedule, p, v, m, drawn))


def _timeline_title(schedule: str, p: int, v: int, m: int, drawn: int) -> str:
    first = f" (drawn with m={drawn})" if drawn < m else ""
    if p == 1:
        return f"Chosen layout: no pipeline (pp=1), {m} micro-batches accumulated per step{first}"
    bubble = idle_fraction(schedule_timeline(schedule, p, m, v))
    line = f"Chosen layout's pipeline: {schedule}, p={p}, v={v}, m={m}{first}\nsimulated bubble {bubble:.1%} of " \
           "rank 0's step"
    if drawn < m:
        line += f" ({idle_fraction(schedule_timeline(schedule, p, drawn, v)):.1%} at the drawn m={drawn})"
    return line + ("; lighter boxes: later chunks" if v > 1 else "")


def plot_plan(results: list, best, path: str, memory_limit_gb: float, top: int = 8) -> None:
    """Write the figure for ``ultrascale plan --plot``: memory bars of ``results[:top]`` (best first) and the
    pipeline timeline of ``best``, to ``path`` (the format follows its extension)."""
    Figure = _figure_class()
    shown = list(results[:top])
    timeline_height = 2.0 + 0.6 * best.layout.pp
    fig = Figure(figsize=(max(10.0, 1.4 * len(shown)), 6.0 + timeline_height), layout="constrained")
    memory_ax, timeline_ax = fig.subplots(2, 1, height_ratios=[6.0, timeline_height])
    _draw_memory(memory_ax, shown, best, memory_limit_gb)
    _draw_timeline(timeline_ax, best)
    fig.savefig(path, dpi=120)

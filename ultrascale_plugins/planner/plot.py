"""The figure of ``ultrascale plan --plot out.png``: per-GPU memory of the top layouts, and the chosen layout's
pipeline schedule as a timeline (ranks x time, forward / backward / idle), drawn the way the Ultra-Scale Playbook
draws them.

The timeline is the chosen layout's step schedule's (``ultrascale_cost_schedule``): with pp > 1 the pipeline
plugin's simulation (``dims/pipeline/timeline.py``: each schedule is an order of actions per pipeline rank, scheduled
as soon as its rank is free and what it waits for has finished); without one, one rank running each micro-batch's
forward then backward.
"""
from __future__ import annotations


from ..interface.config import ConfigError
from ..interface.extras import install_command
from ..interface.step_schedule import StepSchedule

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "other")
MEMORY_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c")
KIND_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
MAX_DRAWN_MICROBATCHES = 16


def step_schedule(layout) -> StepSchedule:
    """The schedule a step of the planner's ``layout`` runs (``ultrascale_cost_schedule``: a pipeline's with pp > 1),
    or the default one of a step without one."""
    config = layout.config()
    return config.registry.hook.ultrascale_cost_schedule(config=config) or StepSchedule()


def chunks_of(timeline: list[list[tuple]]) -> int:
    """Stages per rank in a timeline (the chunks its actions name)."""
    return 1 + max((chunk for row in timeline for *_, chunk in row), default=0)


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
                          f"Fix: {install_command('plot')}") from err
    return Figure


def short_label(layout) -> str:
    """Degrees on the first line, then ZeRO stage and batch split, then recomputation and schedule if any."""
    lines = [" ".join([f"dp{layout.dp}", f"tp{layout.tp}", f"pp{layout.pp}"] + ([f"cp{layout.cp}"] if layout.cp > 1
                                                                             else [])
                      + [f"{k}{v}" for k, v in getattr(layout, "extra", {}).items()]),
             f"z{layout.zero_stage} mbs{layout.micro_batch_size} ga{layout.grad_accum}"]
    extra = [] if layout.activation_checkpointing == "none" else [f"rc-{layout.activation_checkpointing}"]
    if layout.pp > 1:
        v = layout.pp_virtual_stages
        extra.append(layout.pp_schedule + (f" v{v}" if v > 1 else ""))
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
    schedule = step_schedule(lay)
    drawn = min(m, max(MAX_DRAWN_MICROBATCHES, 2 * p))  # 2p: enough to reach the steady state
    timeline = schedule.timeline(drawn)
    v = chunks_of(timeline)
    total = max(row[-1][1] for row in timeline)
    fontsize = min(7.0, 450 / total)  # micro-batch numbers shrink with the boxes, and go when unreadable
    for rank, row in enumerate(timeline):
        ax.barh(rank, total, left=0, height=0.8, color="#eeeeee", edgecolor="#bbbbbb", linewidth=0.5)  # idle
        for start, end, kind, mb, chunk in row:
            ax.barh(rank, end - start, left=start, height=0.8, color=_shade(KIND_COLORS[kind], chunk, v),
                    edgecolor="white", linewidth=0.5)
            if fontsize >= 3:
                ax.text((start + end) / 2, rank, str(mb), ha="center", va="center", fontsize=fontsize)
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
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
    ax.set_title(_timeline_title(lay, schedule, v, drawn))


def _timeline_title(lay, schedule: StepSchedule, v: int, drawn: int) -> str:
    p, m = lay.pp, lay.grad_accum
    first = f" (drawn with m={drawn})" if drawn < m else ""
    if p == 1:
        return f"Chosen layout: no pipeline (pp=1), {m} micro-batches accumulated per step{first}"
    bubble = idle_fraction(schedule.timeline(m))
    line = f"Chosen layout's pipeline: {lay.pp_schedule}, p={p}, v={v}, m={m}{first}\nsimulated bubble {bubble:.1%} " \
           "of rank 0's step"
    if drawn < m:
        line += f" ({idle_fraction(schedule.timeline(drawn)):.1%} at the drawn m={drawn})"
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

"""The headroom rule: the first choice leaves room for the memory estimate's error whenever any layout does.

A layout "fits" when its predicted peak is within the GPU's memory. The prediction is not exact: against the
Ultra-Scale Playbook's 1,127 completed runs (``benchmarks/planner_playbook.py``, docs/planner.md) its error,
|predicted - measured| / measured, is 8 % at the median and 26.3 % at the 90th percentile, and the large errors
are under-predictions. A peak under-predicted by a share e of itself is predicted at (1 - e) of what it is, so a
layout whose prediction leaves ``MEMORY_MARGIN`` of the GPU's memory free fits even when it is that wrong: it "has
headroom". The ranking puts every runnable layout with headroom first (by speed), before faster ones at the edge,
however much faster: a layout the planner itself says may run out of memory is no recommendation while another
is safe (the plan shows the fastest one at the edge beside the choice, with its risk). ``--memory-margin`` is the
one option; a margin of 0 ranks by speed alone.
"""
from __future__ import annotations

# the memory estimate's 90th-percentile error against the Playbook's measured runs
# (benchmarks/results/planner_playbook.json "memory_p90_error"; tests/test_planner.py keeps the two equal)
MEMORY_MARGIN = 0.263


def free_fraction(result, limit_gb: float) -> float:
    """The share of the GPU's memory the prediction leaves free (negative when it does not fit)."""
    return 1 - result.memory_gb["total"] / limit_gb


def has_headroom(result, limit_gb: float, margin: float = MEMORY_MARGIN) -> bool:
    """Whether ``result`` fits ``limit_gb`` leaving at least ``margin`` of it free."""
    return result.fits and free_fraction(result, limit_gb) >= margin


def first_with_headroom(results: list, limit_gb: float, margin: float = MEMORY_MARGIN):
    """The first runnable layout of ``results`` (ranked) that leaves ``margin`` free, or None."""
    return next((r for r in results if r.runnable and has_headroom(r, limit_gb, margin)), None)


def prefer_headroom(results: list, limit_gb: float, margin: float = MEMORY_MARGIN) -> list:
    """``results`` (ranked by speed, those that fit first) with the first runnable layout that has headroom moved
    to the front: the first choice leaves the margin whenever any layout does. The others keep their order by
    speed, so the faster layouts at the edge it was chosen over are listed right below it, each with its risk."""
    first = first_with_headroom(results, limit_gb, margin)
    if first is None:
        return list(results)
    return [first] + [r for r in results if r is not first]


def faster_at_the_edge(best, results: list, limit_gb: float, margin: float = MEMORY_MARGIN):
    """The fastest runnable layout of ``results`` that fits only as predicted and is faster than ``best`` (a choice
    with headroom), or None: what the plan shows beside the choice, with its risk."""
    faster = [r for r in results if r.fits and r.runnable and not has_headroom(r, limit_gb, margin)
              and r.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu]
    return max(faster, key=lambda r: r.tokens_per_s_per_gpu, default=None)


def edge_risk(edge, best, limit_gb: float) -> str:
    """``edge`` (a layout at the edge, faster than the choice ``best``) and its risk, in words."""
    gain = edge.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu - 1
    return (f"{edge.layout.label()} is {gain:.1%} faster at {edge.memory_gb['total']:.1f} GB, only "
            f"{free_fraction(edge, limit_gb):.1%} free: it may run out of memory")


def status(result, limit_gb: float, margin: float = MEMORY_MARGIN) -> str:
    """'yes' (fits with headroom), 'edge' (fits the prediction, not the margin) or 'NO'."""
    if not result.fits:
        return "NO"
    return "yes" if has_headroom(result, limit_gb, margin) else "edge"


def explain(margin: float, limit_gb: float) -> str:
    """The table's footnote on 'yes' and 'edge' and how they rank."""
    if margin <= 0:
        return "ranked by speed alone (--memory-margin 0)"
    why = (": the memory estimate's 90th-percentile error, so a peak predicted that much too low still fits"
           if margin == MEMORY_MARGIN else "")
    return (f"fits 'yes': leaves {margin:.1%} of the memory free (a prediction of at most {limit_gb * (1 - margin):.1f} "
            f"GB){why}; 'edge': fits only as predicted.\n Every layout with that room ranks before the faster ones at "
            "the edge")

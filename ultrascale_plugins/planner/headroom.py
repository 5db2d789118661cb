"""The headroom rule: among the layouts that fit, prefer one that leaves room for the memory estimate's error when
it costs little speed.

A layout "fits" when its predicted peak is within the GPU's memory. The prediction is not exact: against the
Ultra-Scale Playbook's 1,127 completed runs (``benchmarks/planner_playbook.py``, docs/planner.md) its error,
|predicted - measured| / measured, is 8 % at the median and 26.3 % at the 90th percentile, and the large errors
are under-predictions. A peak under-predicted by a share e of itself is predicted at (1 - e) of what it is, so a
layout whose prediction leaves ``MEMORY_MARGIN`` of the GPU's memory free fits even when it is that wrong: it "has
headroom". The ranking puts the layouts with headroom within ``SPEED_TOLERANCE`` of the fastest fitting one first
(by speed), before faster ones at the edge. Both are options of ``ultrascale plan`` (``--memory-margin``,
``--speed-tolerance``); a margin of 0 ranks by speed alone.
"""
from __future__ import annotations

# the memory estimate's 90th-percentile error against the Playbook's measured runs
# (benchmarks/results/planner_playbook.json "memory_p90_error"; tests/test_planner.py keeps the two equal)
MEMORY_MARGIN = 0.263
# speed given up for headroom at most: about what the time model resolves (its predictions of the published
# Frontier runs are 2-5 points of MFU off; docs/planner.md)
SPEED_TOLERANCE = 0.03


def free_fraction(result, limit_gb: float) -> float:
    """The share of the GPU's memory the prediction leaves free (negative when it does not fit)."""
    return 1 - result.memory_gb["total"] / limit_gb


def has_headroom(result, limit_gb: float, margin: float = MEMORY_MARGIN) -> bool:
    """Whether ``result`` fits ``limit_gb`` leaving at least ``margin`` of it free."""
    return result.fits and free_fraction(result, limit_gb) >= margin


def prefer_headroom(results: list, limit_gb: float, margin: float = MEMORY_MARGIN,
                    tolerance: float = SPEED_TOLERANCE) -> list:
    """``results`` (ranked by speed, those that fit first) with the runnable layouts that have headroom and are
    within ``tolerance`` of the fastest fitting one moved to the front, in their order."""
    fitting = [r.tokens_per_s_per_gpu for r in results if r.fits and r.runnable]
    if not fitting:
        return list(results)
    floor = max(fitting) * (1 - tolerance)
    first = [r for r in results if r.runnable and r.tokens_per_s_per_gpu >= floor and has_headroom(r, limit_gb, margin)]
    chosen = {id(r) for r in first}
    return first + [r for r in results if id(r) not in chosen]


def status(result, limit_gb: float, margin: float = MEMORY_MARGIN) -> str:
    """'yes' (fits with headroom), 'edge' (fits the prediction, not the margin) or 'NO'."""
    if not result.fits:
        return "NO"
    return "yes" if has_headroom(result, limit_gb, margin) else "edge"


def explain(margin: float, tolerance: float, limit_gb: float) -> str:
    """The table's footnote on 'yes' and 'edge' and how they rank."""
    if margin <= 0:
        return "ranked by speed alone (--memory-margin 0)"
    why = (": the memory estimate's 90th-percentile error, so a peak predicted that much too low still fits"
           if margin == MEMORY_MARGIN else "")
    return (f"fits 'yes': leaves {margin:.1%} of the memory free (a prediction of at most {limit_gb * (1 - margin):.1f} "
            f"GB){why}; 'edge': fits only as predicted.\n A layout with that room within {tolerance:.0%} of the "
            "fastest ranks before faster ones at the edge")

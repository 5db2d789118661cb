"""What ``ultrascale calibrate`` fits to its measurements, in the planner's own time model (``cost.py``):

- matmuls: a kernel of k GFLOP takes k / (tflops x eff(k)) with eff(k) = matmul_efficiency x k / (k +
  half_efficiency_gflop). With ``tflops`` the highest throughput measured, 1 / eff = a + b / k is a straight line in
  1 / k, fitted for the least largest relative error on the measured times;
- collectives: a message of n bytes over a group of g ranks takes latency + n x share(g) / bus bandwidth (the
  alpha-beta model; ``hardware.bus_share``), fitted the same way.
"""
from __future__ import annotations

import itertools
import math
import statistics

from .hardware import bus_share

# the smallest figures a fit reports: below what the timers resolve, said as this rather than as zero
MIN_HALF_GFLOP = 1e-4
MIN_LATENCY_S = 1e-7


def _line(xs, ys) -> tuple[float, float]:
    """(a, b) of y = a + b x with the least largest relative error max |(a + b x) / y - 1| over the points (the
    Chebyshev fit: lines are a Haar system, so the best line on all points is the best on the triple of points whose
    own best line errs most; a triple's best line errs alike, alternating in sign, on its three points)."""
    points = sorted(zip(xs, ys))
    if len(points) < 2 or points[0][0] == points[-1][0]:
        return _flat(ys), 0.0
    if len(points) == 2:
        (x0, y0), (x1, y1) = points
        b = (y1 - y0) / (x1 - x0)
        return y0 - b * x0, b
    best = (-1.0, 0.0, 0.0)
    for triple in itertools.combinations(points, 3):
        solved = _alternating(triple)
        if solved is not None and abs(solved[0]) > best[0]:
            best = (abs(solved[0]), solved[1], solved[2])
    return best[1], best[2]


def _alternating(triple):
    """(error, a, b) of the line erring by +e, -e, +e relatively on the three points; None if they are degenerate."""
    import numpy as np

    rows = [[1 / y, x / y, sign] for (x, y), sign in zip(triple, (-1, 1, -1))]
    try:
        a, b, e = np.linalg.solve(np.array(rows), np.ones(3))
    except np.linalg.LinAlgError:
        return None
    return float(e), float(a), float(b)


def _flat(ys) -> float:
    """a of y = a with the least largest relative error: the harmonic mean of the extremes."""
    return 2 / (1 / min(ys) + 1 / max(ys))


def fit_matmul(points, tflops: float) -> dict:
    """``matmul_efficiency`` and ``half_efficiency_gflop`` through ``points`` ((GFLOP, seconds), ...) at the peak
    ``tflops``. A machine whose throughput does not rise with size (b < 0) gets the smallest half-efficiency size."""
    ks = [k for k, _ in points]
    inverse_eff = [tflops * 1e3 * t / k for k, t in points]  # 1 / eff: the peak's time over the measured time
    a, b = _line([1 / k for k in ks], inverse_eff)
    if b <= 0 or a <= 0:
        a, b = _flat(inverse_eff), 0.0
    return {"matmul_efficiency": 1 / a, "half_efficiency_gflop": max(b / a, MIN_HALF_GFLOP)}


def matmul_seconds(gflop: float, tflops: float, matmul_efficiency: float, half_efficiency_gflop: float) -> float:
    """What the planner predicts for one matmul of ``gflop`` (``cost.CostModel.evaluate``'s compute term)."""
    eff = matmul_efficiency * gflop / (gflop + half_efficiency_gflop)
    return gflop * 1e9 / (tflops * 1e12 * eff)


def fit_collective(collective: str, group: int, points) -> dict:
    """``latency_s`` and ``bus_gbps`` through ``points`` ((message bytes, seconds), ...) of one collective over
    ``group`` ranks, and ``worst_error``: the largest relative error of the fit on the points."""
    share = bus_share(collective, group)
    xs = [n * share for n, _ in points]
    ts = [t for _, t in points]
    alpha, slope = _line(xs, ts)
    if slope <= 0:  # time does not grow with size: latency alone, and the largest message's rate (a lower bound)
        alpha, slope = _flat(ts), max(ts) / max(xs)
    elif alpha < 0:
        alpha, slope = 0.0, _flat([t / x for x, t in zip(xs, ts)])
    alpha = max(alpha, MIN_LATENCY_S)
    worst = max(abs((alpha + x * slope) / t - 1) for x, t in zip(xs, ts))
    return {"latency_s": alpha, "bus_gbps": 1 / slope / 1e9, "worst_error": worst}


def latency_constants(fits: dict) -> dict:
    """The time model's latency constants from the fitted curves ({collective: {group: fit}}): ``p2p_latency_s``
    the point-to-point latency, ``collective_latency_s`` the median over collectives and groups of the latency
    per tree level (the model's latency x ceil(log2 group))."""
    out = {}
    if "p2p" in fits:
        out["p2p_latency_s"] = statistics.median(f["latency_s"] for f in fits["p2p"].values())
    levels = [f["latency_s"] / math.ceil(math.log2(group)) for name, by_group in fits.items() if name != "p2p"
              for group, f in by_group.items()]
    if levels:
        out["collective_latency_s"] = statistics.median(levels)
    return out


def layer_elements(mc, tp: int = 1, sp: bool = False) -> float:
    """Elements per token of one decoder layer's activations without recomputation (docs/planner.md,
    "Activations": (q + 2k) + (q + k) + q + g·f over t, the norms' 4h over t under sequence parallel): what the
    step's element-wise kernels read and write scales with these."""
    heads = getattr(mc, "num_attention_heads", 1)
    dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    q, k = heads * dim, (getattr(mc, "num_key_value_heads", None) or heads) * dim
    f = getattr(mc, "moe_intermediate_size", None) if getattr(mc, "num_experts", None) else None
    f = f * (mc.num_experts_per_tok + bool(getattr(mc, "shared_expert_intermediate_size", 0))) if f else \
        (getattr(mc, "intermediate_size", None) or 4 * mc.hidden_size)
    return (3 * q + 3 * k + 4 * f) / tp + 4 * mc.hidden_size / (tp if sp else 1)


def fit_step_kernels(step: dict, tflops: float, matmul: dict, layer_shape: dict) -> dict:
    """The time model's constants for a step's kernels beyond the matmuls, from ``step`` (``calibrate.measure_step``):
    ``attention_efficiency`` (attention's FLOPs, as the planner counts them, over the peak), ``layer_call_s`` and
    ``element_s`` (a decoder layer's time beyond its matmuls and attention: a fixed part per layer and micro-batch,
    and a part per token and ``layer_elements`` of activations: a line through the layer measured at two token
    counts), ``optimizer_elements_s`` (fused AdamW's elements per second on one device)."""
    import types

    gflop, seconds = step["attention"]
    attention_eff = gflop / seconds / (tflops * 1e3)
    elements = layer_elements(types.SimpleNamespace(**layer_shape))
    heads, dim = layer_shape["num_attention_heads"], layer_shape["head_dim"]
    rest = []
    for tokens, t, matmul_gflop, kernel_gflop, seq in step["layer"]:
        t_matmul = matmul_seconds(kernel_gflop, tflops, matmul["matmul_efficiency"],
                                  matmul["half_efficiency_gflop"]) * matmul_gflop / kernel_gflop
        t_attention = 12 * heads * dim * seq * tokens / (tflops * 1e12 * attention_eff)
        rest.append((tokens * elements, max(t - t_matmul - t_attention, MIN_LATENCY_S)))
    call, per_element = _line([x for x, _ in rest], [t for _, t in rest])
    if per_element <= 0 or call < 0:
        call, per_element = 0.0, _flat([t / x for x, t in rest])
    numel, t_opt = step["adamw"]
    return {"attention_efficiency": attention_eff, "layer_call_s": max(call, MIN_LATENCY_S),
            "element_s": per_element, "optimizer_elements_s": numel / t_opt}

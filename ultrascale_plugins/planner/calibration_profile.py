"""What ``ultrascale calibrate``'s measurements become: the hardware profile (``hardware_profile`` reads it) — the
``Hardware`` figures, the fitted constants, the collective curves, every measured point, where, when and with what
it was measured, and notes on what was not — and the short table the command prints.
"""
from __future__ import annotations

import collections

import torch

from .calibration_fit import fit_collective, fit_matmul, fit_step_kernels, latency_constants, matmul_seconds
from .machine_bench import LAYER_SHAPE
from .hardware_profile import FORMAT, VERSION


def build_profile(local: dict, measured: list[dict], nproc: int, args, seconds: float) -> dict:
    """The profile from ``local`` (``calibrate.measure_here``) and ``measured`` (``collective_bench.measure``'s
    points) over ``nproc`` processes."""
    bf16 = local["matmul"]["bf16"]
    tflops = max(k / t for k, t in bf16) / 1e3
    constants = fit_matmul(bf16, tflops)
    constants.update(fit_step_kernels(local["step"], tflops, constants, LAYER_SHAPE))
    fits = collective_fits(measured)
    constants.update(latency_constants(fits))
    cpu = local["kind"] == "cpu"
    if cpu:  # the host is the device: offloaded states step at the device's speed, one thread per process
        constants["host_step_elements_s"] = constants["optimizer_elements_s"] * nproc
    host_link = local["copy_gbps"] / 2 if cpu else min(local["host_link"].values())
    notes = []
    if "p2p" in fits:
        intra = fits["p2p"][2]["bus_gbps"]
    else:
        intra = host_link
        notes.append("intra_node_gbps: not measured (one process): the host link's figure stands in")
    if args.inter_node_gbps is None:
        notes.append(f"inter_node_gbps: not measured (one node): the intra-node figure, {intra:.3g} GB/s; give "
                     "--inter-node-gbps for a cluster")
    if cpu:
        notes.append("a CPU: memory_gb and host_memory_gb are each process's share of the host memory, "
                     "host_link_gbps is the memory copy (bytes moved per second), gpus_per_node the processes")
    hardware = {"name": f"{local['device']} on {local['host']}",
                "memory_gb": local["memory_gb"] / (nproc if cpu else 1), "tflops": tflops,
                "intra_node_gbps": intra, "inter_node_gbps": args.inter_node_gbps or intra, "gpus_per_node": nproc,
                "host_link_gbps": host_link, "host_memory_gb": local["host_memory_gb"] / max(1, nproc)}
    return {"format": FORMAT, "version": VERSION, "hardware": hardware, "constants": constants,
            "collectives": {name: {str(g): fit for g, fit in by_group.items()} for name, by_group in fits.items()},
            "matmul": {dtype: matmul_record(points, tflops, constants) for dtype, points in local["matmul"].items()},
            "step": {key: local["step"][key] for key in ("attention", "layer", "adamw")},
            "memory": {"copy_gbps": local["copy_gbps"], **({"host_link": local["host_link"]} if not cpu else {})},
            "measured": {"host": local["host"], "device": local["device"], "date": local["date"],
                         "torch": torch.__version__, "processes": nproc, "threads_per_process": local["threads"],
                         "backend": "gloo" if cpu else "nccl", "quick": bool(args.quick),
                         "seconds": round(seconds, 1)},
            "notes": notes}


def collective_fits(measured: list[dict]) -> dict:
    """{collective: {group: fit with its points}} from the measured points."""
    points = collections.defaultdict(list)
    for p in measured:
        points[(p["collective"], p["group"])].append((p["bytes"], p["seconds"]))
    fits: dict = collections.defaultdict(dict)
    for (name, group), pts in points.items():
        fits[name][group] = {**fit_collective(name, group, pts), "points": [list(p) for p in pts]}
    return dict(fits)


def matmul_record(points, tflops: float, constants: dict) -> dict:
    """One dtype's matmul points ([GFLOP, seconds, the fitted model's seconds]), its best throughput, and the
    bf16 fit's largest relative error on them (the fit is bf16's: fp32's error says how far it is from fp32)."""
    rows = [[k, t, matmul_seconds(k, tflops, constants["matmul_efficiency"], constants["half_efficiency_gflop"])]
            for k, t in points]
    return {"tflops": max(k / t for k, t in points) / 1e3, "points": rows,
            "worst_error": max(abs(model / t - 1) for _, t, model in rows)}


def table(profile: dict, tolerance: float) -> str:
    """What was measured, in a few lines."""
    hw, c, m = profile["hardware"], profile["constants"], profile["measured"]
    bf16 = profile["matmul"]["bf16"]
    threads = f", {m['threads_per_process']} thread(s) each" if m["backend"] == "gloo" else ""
    lines = [f"ultrascale calibrate: {hw['name']}, {m['processes']} process(es) ({m['backend']}{threads}), "
             f"torch {m['torch']}, {m['seconds']:.0f} s",
             f"  matmul bf16  {bf16['tflops']:.4g} TFLOP/s at best; fit: efficiency {c['matmul_efficiency']:.3g}, "
             f"half of it at {c['half_efficiency_gflop']:.3g} GFLOP, worst point {bf16['worst_error']:.0%}"
             + (f" (over {tolerance:.0%}: a busy machine? run it again)" if bf16["worst_error"] > tolerance else ""),
             f"  matmul fp32  {profile['matmul']['fp32']['tflops']:.4g} TFLOP/s at best",
             f"  memory       copy {profile['memory']['copy_gbps']:.3g} GB/s (read + write); host link "
             f"{hw['host_link_gbps']:.3g} GB/s" + (" (on a CPU: the memory copy)" if m["backend"] == "gloo" else ""),
             f"  memory       {hw['memory_gb']:.3g} GB per device, {hw['host_memory_gb']:.3g} GB of host memory each"]
    lines.append(f"  step         attention at {c['attention_efficiency']:.3g} of the peak; a layer "
                 f"{c['layer_call_s'] * 1e6:.0f} us per call + {c['element_s'] * 1e9:.3g} ns per token and "
                 f"activation element; fused AdamW {c['optimizer_elements_s'] / 1e6:.3g} M elements/s")
    if profile["collectives"]:
        lines.append(f"  {'collective':<15}{'group':>6}{'latency':>12}{'bus GB/s':>10}{'fit error':>11}")
        for name, by_group in profile["collectives"].items():
            for group, fit in by_group.items():
                lines.append(f"  {name:<15}{group:>6}{fit['latency_s'] * 1e6:>10.1f}us{fit['bus_gbps']:>10.3g}"
                             f"{fit['worst_error']:>11.0%}")
    lines += [f"  note: {note}" for note in profile["notes"]]
    return "\n".join(lines)

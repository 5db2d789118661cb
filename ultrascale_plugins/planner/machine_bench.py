"""``ultrascale calibrate``'s measurements in one process: matmul throughput by kernel size and dtype, memory
bandwidth (a large copy), the host link (pinned host <-> device copies on a GPU; on a CPU the host is the device,
so the link is the memory copy itself), and the machine's memory. Each point is the median of its repeats, each
repeat long enough for the timer (a loop of kernels), after a warm-up.
"""
from __future__ import annotations

import os
import statistics
import time

import torch


def device() -> torch.device:
    """The device a step runs on here: the first GPU when one is visible, else the CPU (and with
    ``ULTRASCALE_DEVICE=cpu``, as the workers read it: ``distributed.launch.device_for_rank``)."""
    if torch.cuda.is_available() and os.environ.get("ULTRASCALE_DEVICE", "") != "cpu":
        return torch.device("cuda", 0)
    return torch.device("cpu")


def sync(dev: torch.device) -> None:
    """Wait for the device's queued kernels (a GPU's; a CPU runs them as they are called)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeats: int, min_s: float) -> float:
    """Seconds of one ``fn()``: the median of ``repeats`` timings, each of enough calls to last ``min_s``."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    calls = max(1, int(min_s / max(time.perf_counter() - t0, 1e-9)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(dev)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def matmul_point(n: int, dtype: torch.dtype, dev: torch.device, repeats: int, min_s: float) -> tuple[float, float]:
    """(GFLOP, seconds) of an n x n by n x n matmul in ``dtype``."""
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    return 2 * n ** 3 / 1e9, timed(lambda: torch.mm(a, b), dev, repeats, min_s)


def copy_gbps(nbytes: int, dev: torch.device, repeats: int, min_s: float) -> float:
    """GB/s of a large copy on ``dev``, counting the bytes read and written (STREAM's copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), dev, repeats, min_s) / 1e9


def host_link_gbps(nbytes: int, dev: torch.device, repeats: int, min_s: float) -> dict:
    """GB/s of pinned host-to-device and device-to-host copies of ``nbytes`` (one direction each)."""
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    to_device = timed(lambda: on_device.copy_(host, non_blocking=True), dev, repeats, min_s)
    to_host = timed(lambda: host.copy_(on_device, non_blocking=True), dev, repeats, min_s)
    return {"to_device_gbps": nbytes / to_device / 1e9, "to_host_gbps": nbytes / to_host / 1e9}


def host_memory_gb() -> float:
    """This machine's memory in GB (16 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 16.0


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def device_memory_gb(dev: torch.device) -> float:
    return torch.cuda.get_device_properties(dev).total_memory / 1e9

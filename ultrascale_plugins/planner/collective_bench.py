"""``ultrascale calibrate``'s collective timings: N local processes, started as the package starts its workers (one
Python process per rank with torchrun's variables, ``distributed.launch.init_distributed``: NCCL on GPUs, gloo on
CPUs), each collective over the first g ranks for every group size g from 2 to N, at each message size; a point is
the median of its repeats on rank 0, each a loop of calls after a barrier. Every collective is bounded by the
process group's timeout, and the whole measurement by the caller's deadline. Rank 0 appends a line to a progress
file per point (the caller's bar) and writes the points as JSON.

Run as ``python -m ultrascale_plugins.planner.collective_bench SPEC.json`` (``measure`` does).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

from ..distributed.supervisor import free_port
from ..interface.config import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def points_to_measure(nproc: int, sizes) -> list[tuple[str, int, int]]:
    """(collective, group size, message bytes) in the order they are measured: point to point between ranks 0
    and 1 only."""
    return [(name, group, size) for group in range(2, nproc + 1) for name in COLLECTIVES
            if name != "p2p" or group == 2 for size in sizes]


def measure(nproc: int, sizes, repeats: int, min_s: float, timeout_s: float, deadline_s: float,
            on_point=None) -> list[dict]:
    """Time every point of ``points_to_measure`` over ``nproc`` processes, each the median of ``repeats`` timings
    of at least ``min_s``; ``on_point()`` after each. A worker that fails, or a measurement past ``deadline_s``, is
    a ``ConfigError`` with the worker's last words."""
    with tempfile.TemporaryDirectory(prefix="ultrascale-calibrate-") as tmp:
        spec = {"sizes": list(sizes), "repeats": repeats, "min_s": min_s, "timeout_s": timeout_s,
                "progress": os.path.join(tmp, "progress"), "out": os.path.join(tmp, "points.json")}
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump(spec, f)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        procs = []
        try:
            for rank in range(nproc):
                err = open(os.path.join(tmp, f"rank{rank}.err"), "w")
                procs.append(subprocess.Popen([sys.executable, "-m", __name__, os.path.join(tmp, "spec.json")],
                                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                              stdout=subprocess.DEVNULL, stderr=err))
                err.close()
            _wait(procs, spec, tmp, deadline_s, on_point)
        finally:
            for p in procs:  # the workers this call started, each by its handle
                if p.poll() is None:
                    p.kill()
                    p.wait()
        with open(spec["out"]) as f:
            return json.load(f)


def _wait(procs, spec: dict, tmp: str, deadline_s: float, on_point) -> None:
    """Until every worker has exited: progress ticks to ``on_point``, a failed worker or the deadline refused."""
    start, seen = time.monotonic(), 0
    while True:
        done = os.path.isfile(spec["progress"]) and os.path.getsize(spec["progress"])
        while on_point is not None and seen < done:
            on_point()
            seen += 1
        codes = [p.poll() for p in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            raise ConfigError(f"calibrate: collective worker rank {failed[0]} failed: {_last_words(tmp, failed[0])}. "
                              "Fix: check that the processes can reach 127.0.0.1, or run with --nproc 1 (no "
                              "collectives)")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() - start > deadline_s:
            raise ConfigError(f"calibrate: the collectives took longer than {deadline_s:.0f} s. Fix: use --quick, or "
                              "fewer processes (--nproc)")
        time.sleep(0.05)


def _last_words(tmp: str, rank: int) -> str:
    with open(os.path.join(tmp, f"rank{rank}.err")) as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "no message"


def main(spec_path: str) -> None:
    """One worker: every point, this rank taking part where it is in the group; rank 0 records."""
    import torch.distributed as dist

    from ..distributed.launch import init_distributed

    with open(spec_path) as f:
        spec = json.load(f)
    device = init_distributed(timeout=spec["timeout_s"])
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {g: dist.new_group(list(range(g))) for g in range(2, world + 1)}
    points = []
    for name, group, size in points_to_measure(world, spec["sizes"]):
        if rank < group:  # point to point: group 2, ranks 0 and 1
            nbytes, seconds = _time(name, group, groups[group], size, device, spec["repeats"], spec["min_s"])
            if rank == 0:
                points.append({"collective": name, "group": group, "bytes": nbytes, "seconds": seconds})
                with open(spec["progress"], "a") as f:
                    f.write(".")
        dist.barrier()
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(points, f)
    dist.destroy_process_group()


def _time(name: str, group: int, pg, size: int, device, repeats: int, min_s: float) -> tuple[int, float]:
    """(message bytes, seconds): one collective of about ``size`` bytes over ``pg`` (NCCL's message: an all-gather's
    output, a reduce-scatter's input), the median over ``repeats`` of a loop of calls lasting ``min_s`` or more,
    after a warm-up."""
    import torch
    import torch.distributed as dist

    from .machine_bench import sync

    elements = max(group, size // 4 // group * group)  # fp32, a whole number of shards
    send = torch.zeros(elements, device=device)
    recv = torch.empty(elements, device=device)
    shard = torch.empty(elements // group, device=device)
    with warnings.catch_warnings():  # torch 2.13 renames the *_tensor collectives; the floor has only these names
        warnings.simplefilter("ignore", FutureWarning)
        run = {"all_reduce": lambda: dist.all_reduce(send, group=pg),
               "all_gather": lambda: dist.all_gather_into_tensor(recv, shard, group=pg),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, send, group=pg),
               "all_to_all": lambda: dist.all_to_all_single(recv, send, group=pg),
               "p2p": lambda: _ping_pong(send, recv)}[name]
        calls = None
        times = []
        for _ in range(repeats + 1):
            dist.barrier(group=pg)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls or 1):
                run()
            sync(device)
            seconds = time.perf_counter() - t0
            if calls is None:  # the warm-up: as many calls per timing as the slowest rank needs for min_s
                slowest = torch.tensor([seconds], device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=pg)
                calls = max(1, min(1000, int(min_s / max(slowest.item(), 1e-9))))
            else:
                times.append(seconds / calls)
    return elements * 4, statistics.median(times) / (2 if name == "p2p" else 1)


def _ping_pong(send, recv) -> None:
    """Rank 0 sends to rank 1 and receives its answer: twice one point-to-point transfer."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.send(send, 1)
        dist.recv(recv, 1)
    else:
        dist.recv(recv, 0)
        dist.send(send, 0)


if __name__ == "__main__":
    main(sys.argv[1])

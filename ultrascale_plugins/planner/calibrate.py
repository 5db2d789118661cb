"""``ultrascale calibrate``: measure the machine it runs on and write a hardware profile that ``--gpu FILE`` accepts
(``hardware_profile``): matmul throughput in bf16 and fp32 by kernel size (``machine_bench``), fitted to the
planner's matmul model (``calibration_fit``); memory bandwidth and the host link; each collective's latency and bus
bandwidth by group size over N local processes (``collective_bench``). One node only: the figure between nodes is
the one given (``--inter-node-gbps``) or the intra-node one, and the profile says which.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import time

from ..interface.config import ConfigError

DEFAULT_OUT = "hardware-profile.json"
# how far the fitted matmul model may stray from a measured point before the command says the fit is poor (a busy
# machine's timings scatter; the profile keeps every point and the fit's error on it)
FIT_TOLERANCE = 0.5


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures: square matmuls of these sides, a copy of ``copy_bytes``, messages of these bytes,
    each point the median of ``repeats`` timings of at least ``min_s``; the collectives end by ``deadline_s``."""
    matmul_sides: tuple
    copy_bytes: int
    message_bytes: tuple
    repeats: int
    min_s: float
    deadline_s: float
    collective_timeout_s: float = 60.0
    layer_seq: int = 512  # the sequence of the attention and decoder layer measured (``machine_bench``)


def settings(on_gpu: bool, quick: bool) -> Settings:
    """A few minutes at most by default; ``quick``: seconds (fewer sizes and repeats), what the tests use."""
    kib, mib = 1024, 1024 * 1024
    if on_gpu:
        if quick:
            return Settings((512, 2048, 8192), 256 * mib, (64 * kib, 4 * mib, 64 * mib), 3, 0.005, 120)
        return Settings((256, 512, 1024, 2048, 4096, 8192), 1024 * mib,
                        (4 * kib, 256 * kib, 4 * mib, 64 * mib, 512 * mib), 5, 0.02, 300)
    if quick:
        return Settings((64, 256, 512), 16 * mib, (4 * kib, 256 * kib, 2 * mib), 5, 0.005, 120, layer_seq=256)
    return Settings((64, 128, 256, 512, 1024, 2048), 256 * mib, (4 * kib, 64 * kib, 1 * mib, 8 * mib, 32 * mib), 5,
                    0.02, 300)


def add_arguments(p) -> None:
    p.add_argument("--out", default=DEFAULT_OUT, metavar="FILE",
                   help=f"the profile to write (default {DEFAULT_OUT})")
    p.add_argument("--nproc", type=int, metavar="N", help="local processes for the collectives (default: this "
                   "machine's GPUs, or 2 to 4 on a CPU, gloo); 1 measures no collective")
    p.add_argument("--quick", action="store_true", help="seconds instead of minutes: fewer sizes and repeats")
    p.add_argument("--inter-node-gbps", type=float, metavar="GBPS", help="per-device bandwidth between nodes, GB/s "
                   "one direction (not measured: one node); default: the intra-node figure measured")


def check_args(args, on_gpu: bool) -> int:
    """The process count, after checking every argument (before any measurement)."""
    import torch

    if os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise ConfigError(f"--out {args.out}: not a file in an existing folder. Fix: e.g. --out {DEFAULT_OUT}")
    if args.inter_node_gbps is not None and not args.inter_node_gbps > 0:
        raise ConfigError(f"--inter-node-gbps {args.inter_node_gbps}: must be positive. Fix: e.g. the network's "
                          "GB/s per device, such as 50 for 400 Gb/s per GPU")
    default = torch.cuda.device_count() if on_gpu else min(4, max(2, os.cpu_count() or 2))
    nproc = default if args.nproc is None else args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: must be at least 1. Fix: e.g. --nproc 2")
    if on_gpu and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc}: this machine has {torch.cuda.device_count()} GPUs. Fix: at most one "
                          "process per GPU")
    return nproc


def run_calibrate(args) -> int:
    """Measure, fit, write the profile, check it reads back as the planner reads it, print what was measured."""
    from tqdm import tqdm

    from . import machine_bench
    from .collective_bench import measure, points_to_measure
    from .hardware_profile import read_profile, write_profile

    dev = machine_bench.device()
    nproc = check_args(args, dev.type == "cuda")
    plan = settings(dev.type == "cuda", args.quick)
    collective_points = points_to_measure(nproc, plan.message_bytes) if nproc > 1 else []
    start = time.monotonic()
    with tqdm(total=2 * len(plan.matmul_sides) + 4 + len(collective_points), desc="ultrascale calibrate",
              unit="point", file=sys.stderr, dynamic_ncols=True) as bar:
        local = measure_local(dev, nproc, plan, bar.update)
        measured = measure(nproc, plan.message_bytes, plan.repeats, plan.min_s, plan.collective_timeout_s,
                           plan.deadline_s, bar.update) if nproc > 1 else []
    from .calibration_profile import build_profile, table

    profile = build_profile(local, measured, nproc, args, time.monotonic() - start)
    write_profile(args.out, profile)
    read_profile(args.out)  # what --gpu will read, checked now
    print(table(profile, FIT_TOLERANCE))
    print(f"ultrascale: wrote {args.out}; plan with it: ultrascale plan --gpu {args.out} --model ... --gpus ...")
    return 0


def measure_local(dev, nproc: int, plan: Settings, tick) -> dict:
    """``measure_here``; on a CPU with several processes, in ``nproc`` processes at once, each point started
    together and taken from the slowest process: the step's ranks share the cores, the memory bandwidth and the
    caches, and a step waits for its slowest rank (a GPU's ranks share none of these: measured in one process)."""
    if dev.type != "cpu" or nproc <= 1:
        return measure_here(dev, nproc, plan, tick)
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(nproc), ctx.Queue()
    procs = [ctx.Process(target=_measure_child, args=(nproc, plan, barrier, queue, rank), daemon=True)
             for rank in range(nproc)]
    for p in procs:
        p.start()
    try:
        results = [_answer(queue, procs) for _ in procs]
    finally:
        for p in procs:  # the processes this call started, each by its handle
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        raise ConfigError(f"calibrate: a measuring process failed: {failed[0]}")
    for _ in range(2 * len(plan.matmul_sides) + 4):
        tick()
    return _slowest(sorted(results, key=lambda r: r["rank"]))


def _answer(queue, procs):
    """The next process's measurements (or its error), waiting as long as every process is alive or has answered
    (a loaded machine measures slowly: no deadline), refused when one died without answering."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise ConfigError("calibrate: a measuring process died. Fix: check the machine's memory, or use "
                                  "fewer processes (--nproc)") from None


def _measure_child(nproc: int, plan: Settings, barrier, queue, rank: int) -> None:
    """One of ``measure_local``'s processes: ``measure_here`` with every point started with the others'."""
    import torch

    try:
        barrier.wait()
        queue.put({**measure_here(torch.device("cpu"), nproc, plan, barrier.wait), "rank": rank})
    except Exception as exc:  # said by the parent, in one line
        queue.put(f"{type(exc).__name__}: {exc}")


def _slowest(results: list[dict]) -> dict:
    """The processes' measurements merged point by point: each time the slowest process's, the copy's rate the
    lowest."""
    def slowest(points_of) -> list:
        rows = [points_of(r) for r in results]
        return [(*row[:1], max(r[i][1] for r in rows), *row[2:]) for i, row in enumerate(rows[0])]

    out = dict(results[0])
    out["matmul"] = {name: slowest(lambda r: r["matmul"][name]) for name in results[0]["matmul"]}
    out["copy_gbps"] = min(r["copy_gbps"] for r in results)
    out["step"] = {"attention": slowest(lambda r: [r["step"]["attention"]])[0],
                   "layer": slowest(lambda r: r["step"]["layer"]),
                   "adamw": slowest(lambda r: [r["step"]["adamw"]])[0]}
    return out


def measure_here(dev, nproc: int, plan: Settings, tick) -> dict:
    """This process's measurements: matmuls at the threads one of ``nproc`` workers runs (the launcher gives each
    of several CPU processes one thread unless OMP_NUM_THREADS says), the copy, the host link, the memory."""
    import torch

    from . import machine_bench

    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or (1 if nproc > 1 else threads))
    try:
        out = {"threads": torch.get_num_threads(), "matmul": {}}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            out["matmul"][name] = []
            for side in plan.matmul_sides:
                out["matmul"][name].append(machine_bench.matmul_point(side, dtype, dev, plan.repeats, plan.min_s))
                tick()
        out["copy_gbps"] = machine_bench.copy_gbps(plan.copy_bytes, dev, plan.repeats, plan.min_s)
        if dev.type == "cuda":
            out["host_link"] = machine_bench.host_link_gbps(plan.copy_bytes // 4, dev, plan.repeats, plan.min_s)
        tick()
        out["step"] = measure_step(dev, plan, tick)
    finally:
        torch.set_num_threads(threads)
    host_gb = machine_bench.host_memory_gb()
    out.update(device=machine_bench.device_name(dev), kind=dev.type, host_memory_gb=host_gb,
               memory_gb=machine_bench.device_memory_gb(dev) if dev.type == "cuda" else host_gb,
               host=socket.gethostname(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return out


def measure_step(dev, plan: Settings, tick) -> dict:
    """A training step's kernels beyond the matmuls (``machine_bench``): causal attention's forward and backward,
    a decoder layer's at two token counts (with the matmul GFLOP the fit subtracts), fused AdamW's step."""
    from . import machine_bench

    seq = plan.layer_seq
    out = {"attention": machine_bench.attention_point(dev, seq, plan.repeats, plan.min_s)}
    tick()
    out["layer"] = [(tokens, seconds, *machine_bench.layer_matmul_gflop(tokens), seq)
                    for tokens, seconds in machine_bench.layer_points(dev, seq, plan.repeats, plan.min_s)]
    tick()
    out["adamw"] = machine_bench.adamw_point(dev, plan.copy_bytes // 16, plan.repeats, plan.min_s)
    tick()
    return out

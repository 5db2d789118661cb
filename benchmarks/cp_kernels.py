"""Ring attention's blocks on PyTorch's SDPA kernels against the portable matmul + softmax path, on CPU.

One process, the ring's plan for a sequence held whole (what Ulysses runs after its all-to-all, and what every
ring step runs on its chunk pairs): forward + backward of ``RingAttention`` on one sequence, plain causal and with
packed documents, fp32 and bf16, with ``cp_kernels.KERNEL`` = ``portable`` (the path before the kernels: fp32
matmul + softmax in tiles of 1024 x 1024) and ``auto`` (on CPU ``_scaled_dot_product_flash_attention_for_cpu``,
in the input dtype). Both settings are measured in the same invocation, so the ratios compare runs on the same
machine and load.

- time: median over ``--repeat`` forward + backward calls per setting after one warm-up each, the two settings'
  calls interleaved in one process (a shared machine's changing load hits both alike);
- memory: in a process per setting, the peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) during its first
  call minus the RSS just before it (``/proc/self/statm``): the transient and saved memory of attention itself, inputs
  and the Python process left out.

    python benchmarks/cp_kernels.py --date 2026-12-04 --out benchmarks/results/cp_kernels_cpu.json

``check_kernels(device, dtype)`` (used by the GPU suite) checks each SDPA kernel of a device on tiny sizes: one
block, and a ring plan of three blocks merged by log-sum-exp with causal, document and window masks, forward and
backward against unsplit ``F.scaled_dot_product_attention`` (math kernel, fp32).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _plan(total: int, seg, window, scale: float, kernel: str, device):
    import torch

    from ultrascale_plugins.dims.context.attention import RingPlan, _Whole

    return RingPlan(_Whole(), total // 2, torch.arange(total, device=device), seg, window, scale, None, 1, kernel)


def _documents(batch: int, total: int, device, pieces: int = 4):
    """Document numbers of ``pieces`` equal documents packed in each row."""
    import torch

    return (torch.arange(total, device=device) * pieces // total).expand(batch, total).contiguous()


# ---- the speed and memory comparison --------------------------------------------------------------------------
def _setup(kernel: str, dtype_name: str, seq: int, heads: int, dim: int, documents: bool):
    """One forward + backward of the ring's blocks over one sequence, as a function of no arguments."""
    import torch

    from ultrascale_plugins.dims.context import kernels as cp_kernels
    from ultrascale_plugins.dims.context.attention import RingAttention

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    q, k, v = (torch.randn(1, heads, seq, dim, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, seq, dim, dtype=dtype)
    seg = _documents(1, seq, "cpu") if documents else None
    plan = _plan(seq, seg, None, dim ** -0.5, cp_kernels.ring_kernel(q, v, None, kernel), "cpu")

    def step():
        out, _ = RingAttention.apply(q, k, v, plan)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    return step


def measure_time(dtype_name: str, seq: int, heads: int, dim: int, documents: bool, repeat: int) -> dict:
    """Forward + backward seconds of both settings, their calls interleaved (old, new, old, new, ...) so that a
    change of load on a shared machine hits both alike."""
    steps = {kernel: _setup(kernel, dtype_name, seq, heads, dim, documents) for kernel in ("portable", "auto")}
    times: dict = {kernel: [] for kernel in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(repeat):
        for kernel, step in steps.items():
            start = time.perf_counter()
            step()
            times[kernel].append(round(time.perf_counter() - start, 4))
    return times


def measure_memory(kernel: str, dtype_name: str, seq: int, heads: int, dim: int, documents: bool) -> float:
    """MB of peak RSS during the first forward + backward above the RSS just before it, in a process of its own:
    the high-water mark cannot be reset, and after a warm-up call the allocator keeps pages that would hide it."""
    import ctypes

    step = _setup(kernel, dtype_name, seq, heads, dim, documents)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed setup memory back, so the RSS before is the live data
    with open("/proc/self/statm") as f:
        rss_before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return round(max(0, peak - rss_before) / 2**20, 1)


def _run_worker(args, *worker_args) -> object:
    cmd = [sys.executable, __file__, "--worker", *map(str, worker_args)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(args) -> dict:
    load = os.getloadavg()[0]  # the machine may be shared: recorded, and the two settings' calls interleaved
    rows = []
    for seq in args.seq:
        for dtype in args.dtype:
            for documents in (False, True):
                shape = (dtype, seq, args.heads, args.head_dim, int(documents))
                times = _run_worker(args, "time", *shape, args.repeat)
                memory = {kernel: _run_worker(args, "memory", kernel, *shape) for kernel in ("portable", "auto")}
                row = {"seq": seq, "dtype": dtype, "documents": documents}
                for kernel, name in (("portable", "portable"), ("auto", "sdpa_kernel")):
                    row[name] = {"median_s": round(statistics.median(times[kernel]), 4), "times_s": times[kernel],
                                 "peak_extra_rss_mb": memory[kernel]}
                old, new = row["portable"], row["sdpa_kernel"]
                row["time_ratio_new_over_old"] = round(new["median_s"] / old["median_s"], 3)
                row["memory_ratio_new_over_old"] = round(new["peak_extra_rss_mb"] /
                                                         max(old["peak_extra_rss_mb"], 0.1), 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
    import torch

    return {"benchmark": "ring attention blocks: SDPA kernel vs portable matmul path, CPU",
            "date": args.date or datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only, OMP_NUM_THREADS={args.threads}",
            "load_average_1min_at_start": round(load, 2), "torch": torch.__version__,
            "script": "benchmarks/cp_kernels.py", "command": "python " + " ".join(sys.argv),
            "method": "RingAttention with the ring plan of a whole sequence (batch 1, 2 chunks, heads x seq x "
                      f"head dim {args.heads} x seq x {args.head_dim}), plain causal or 4 packed documents; "
                      f"forward + backward: median of {args.repeat} calls per setting after one warm-up each, the "
                      "two settings' calls interleaved in one process; memory: in a process per setting, peak RSS "
                      "(getrusage ru_maxrss) during the first call minus RSS before it; new = KERNEL 'auto' "
                      "(_scaled_dot_product_flash_attention_for_cpu, input dtype), old = 'portable' (fp32 matmul)",
            "results": rows}


# ---- the kernels' correctness check (CPU dry run and GPU suite) -------------------------------------------------
def _reference(q, k, v, mask, scale):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*exact, attn_mask=mask, scale=scale)
    return out, exact


def _rel(a, b) -> float:
    return float((a.detach().float() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-6))


def check_kernels(device: str, dtype) -> list[dict]:
    """Each SDPA kernel of ``device`` (CPU: flash_cpu; CUDA: flash, efficient, cudnn, each forced) on tiny sizes:
    ``block`` (one causal block, kernel forward/backward directly) and ``causal`` / ``documents`` / ``window``
    (the ring's plan of a whole sequence: 3 blocks merged by log-sum-exp), forward and backward against unsplit
    ``F.scaled_dot_product_attention`` in fp32 (math kernel). Errors are relative to the largest reference value;
    kernel/case/dtype combinations a kernel does not take (flash: masks and fp32; cudnn: fp32) are left out. A
    kernel that raises gives a row with ``ok`` False and the error."""
    import torch

    from ultrascale_plugins.dims.context import kernels as cp_kernels
    from ultrascale_plugins.dims.context.attention import RingAttention
    from ultrascale_plugins.dims.context.layout import visible

    kernels = ["flash_cpu"] if device == "cpu" else ["flash", "efficient", "cudnn"]
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    batch, heads, seq, dim, scale = 2, 4, 64, 32, 32 ** -0.5
    index = torch.arange(seq, device=device)
    seg = _documents(batch, seq, device, pieces=3)
    cases = {"block": (None, None), "causal": (None, None), "documents": (seg, None), "window": (None, 20)}
    rows = []
    for kernel in kernels:
        for case, (case_seg, window) in cases.items():
            masked = case in ("documents", "window")
            if (kernel == "flash" and masked) or (kernel in ("flash", "cudnn") and dtype == torch.float32):
                continue
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, heads, seq, dim, device=device).to(dtype).requires_grad_()
                       for _ in range(3))
            grad = torch.randn(batch, heads, seq, dim, device=device)
            mask = visible(index, index, case_seg, case_seg, window)
            row = {"kernel": kernel, "case": case, "dtype": str(dtype).replace("torch.", ""), "tol": tol}
            try:
                want, exact = _reference(q, k, v, mask, scale)
                (want * grad).sum().backward()
                if case == "block":
                    out, lse, aux = cp_kernels.block_forward(kernel, q, k, v, None, True, scale)
                    grads = cp_kernels.block_backward(kernel, grad.to(dtype), q, k, v, out, lse, None, True, scale,
                                                      aux)
                else:
                    plan = _plan(seq, case_seg, window, scale, cp_kernels.ring_kernel(q, v, None, kernel), device)
                    out, _ = RingAttention.apply(q, k, v, plan)
                    out.backward(grad.to(dtype))
                    grads = (q.grad, k.grad, v.grad)
                row["max_err_out"] = _rel(out, want)
                row["max_err_grad"] = max(_rel(g, e.grad) for g, e in zip(grads, exact))
                row["ok"] = row["max_err_out"] < tol and row["max_err_grad"] < tol
            except RuntimeError as err:  # e.g. a cuDNN build without this attention: say so, fail the row
                row.update(max_err_out=None, max_err_grad=None, ok=False, error=str(err).splitlines()[0][:300])
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5, help="timed forward + backward calls (median)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each measurement")
    parser.add_argument("--date", help="date to record (default: today)")
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--check", metavar="DEVICE", help="run check_kernels(DEVICE) in fp32 and bf16 and print it")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one measurement, in a process of its own (compare runs these)
        what, rest = args.worker[0], args.worker[1:]
        if what == "time":
            dtype, seq, heads, dim, documents, repeat = rest
            print(json.dumps(measure_time(dtype, int(seq), int(heads), int(dim), bool(int(documents)), int(repeat))))
        else:
            kernel, dtype, seq, heads, dim, documents = rest
            print(json.dumps(measure_memory(kernel, dtype, int(seq), int(heads), int(dim), bool(int(documents)))))
        return
    if args.check:
        import torch

        rows = [r for d in (torch.float32, torch.bfloat16) for r in check_kernels(args.check, d)]
        print(json.dumps(rows, indent=1))
        sys.exit(0 if all(r["ok"] for r in rows) else 1)
    result = compare(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

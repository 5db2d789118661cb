"""Per-rank peak memory of whole training steps, measured, beside the package's own estimate for that rank: six
layouts of a tiny Llama, a bf16 run and the memory features (the chunked loss, bf16 states, torchao's low-bit AdamW,
offloaded states and activations, the step inside the backward) on 2-8 CPU processes (gloo), one torchrun launch
per process count
(``tests/memory_worker.py`` measures; see its docstring for how).

    python benchmarks/own_memory.py                 # every case (about 4 minutes on 2 cores)
    python benchmarks/own_memory.py --extra         # also fused AdamW, one micro-batch, what-if fixes (~90 s)
    python benchmarks/own_memory.py --cases zero3_dp2 ddp_dp2_ac_full --out /tmp/mem.json

Writes ``benchmarks/results/own_memory_cpu.json`` (machine, date, command, and per case and rank: the peak by both
counters, when it happened, what was alive then by category, the estimate's categories) and prints, per rank: the
measured peak (the storage ledger; torch's MemTracker beside it), the estimate (its raw categories summed, and with
``planner.cost.peak_memory_gb``'s allocator constants), and the estimate's error; then, per case, the most loaded
rank's categories measured against estimated.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = ROOT / "tests" / "memory_worker.py"
sys.path.insert(0, str(ROOT / "tests"))

MB = 1e6
CATEGORIES = ("params", "grads", "optimizer", "activations", "other", "total")


def launch(world: int, names: list[str], out: str) -> float:
    """One torchrun launch of the worker over ``names`` on ``world`` processes; its wall time."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(WORKER), out, *names]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"launch of {names} on {world} processes failed ({done.returncode})")
    return time.perf_counter() - start


def error(estimate: float, measured: float) -> str:
    return f"{100 * (estimate - measured) / measured:+.1f}%"


def rank_label(coords: dict) -> str:
    return ",".join(f"{k}{v}" for k, v in coords.items()) or "-"


def print_tables(cases: dict) -> None:
    head = (f"{'case':<26} {'rank':<16} {'peak MB':>8} {'MemTr MB':>8} {'est MB':>8} {'err':>7} "
            f"{'est+c MB':>8} {'err+c':>7}  peak at")
    print(head)
    print("-" * len(head))
    for name, case in cases.items():
        for r in case["ranks"]:
            peak = r["ledger"]["peak"]
            raw, const = r["estimate"]["total"], r["estimate_peak_memory_gb"]["total"]
            at = r["ledger"]["at_peak"]
            print(f"{name:<26} {rank_label(r['coords']):<16} {peak / MB:8.1f} {r['memtracker']['peak'] / MB:8.1f} "
                  f"{raw / MB:8.1f} {error(raw, peak):>7} {const / MB:8.1f} {error(const, peak):>7}  "
                  f"{at['phase']} {at['op'].replace('aten.', '').replace('.default', '')}")
    print("\nmost loaded rank, by category: measured / estimate MB (error)")
    head = f"{'case':<26} " + " ".join(f"{c:>22}" for c in CATEGORIES)
    print(head)
    print("-" * len(head))
    for name, case in cases.items():
        r = max(case["ranks"], key=lambda r: r["ledger"]["peak"])
        cells = []
        for c in CATEGORIES:
            m, e = r["by_category"][c]["measured"], r["by_category"][c]["estimate"]
            cells.append(f"{m / MB:6.1f}/{e / MB:6.1f} ({error(e, m) if m else 'n/a':>6})")
        print(f"{name:<26} " + " ".join(f"{c:>22}" for c in cells))


def main() -> None:
    from memory_worker import CASES, EXTRA_CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help=f"any of {', '.join([*CASES, *EXTRA_CASES])}")
    parser.add_argument("--extra", action="store_true", help="also the extra and what-if cases")
    parser.add_argument("--out", default=str(HERE / "results" / "own_memory_cpu.json"))
    args = parser.parse_args()
    every = {**CASES, **EXTRA_CASES}
    names = args.cases or [*CASES, *(EXTRA_CASES if args.extra else ())]
    unknown = [n for n in names if n not in every]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: one of {', '.join(every)}")
    by_world: dict[int, list[str]] = {}
    for n in names:
        by_world.setdefault(every[n]["world"], []).append(n)
    cases, launches, config = {}, {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for world, group in sorted(by_world.items()):
            out = os.path.join(tmp, f"w{world}.json")
            launches[world] = {"cases": group, "seconds": round(launch(world, group, out), 1)}
            with open(out) as f:
                data = json.load(f)
            config = data["config"]
            cases.update(data["cases"])
    cases = {n: cases[n] for n in names}
    import torch

    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
                   f"Python {platform.python_version()}, torch {torch.__version__}, gloo, OMP_NUM_THREADS=1",
        "command": "python benchmarks/own_memory.py " + " ".join(sys.argv[1:]),
        "launches": launches, "config": config, "cases": cases,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_tables(cases)
    total = sum(v["seconds"] for v in launches.values())
    print(f"\n{len(cases)} cases in {len(launches)} launches, {total:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()

"""The GPU suite: correctness checks, throughput and front-end overhead on one CUDA device, ready to run unattended.

    python benchmarks/gpu_suite.py                         # one GPU, <= 9 minutes: benchmarks/results/gpu/
    python benchmarks/gpu_suite.py --sections moe,checkpoint --out /tmp/gpu
    python benchmarks/gpu_suite.py --dry-run               # the same code on CPU, tiny sizes, a temp directory

Every section runs in its own process (``--section NAME``, world size 1: NCCL on a GPU, gloo in the dry run) under
a time budget; it appends result rows as it goes, so a section that overruns or crashes still leaves its rows,
and the suite records the timeout or error and goes on. Results: ``<out>/<date>-<gpu>.json`` and a markdown table
beside it (``.md``), rewritten after every section. Adding a check is one entry in ``SECTIONS``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_sections import correctness, front_ends, memory, throughput  # noqa: E402
from gpu_sections.common import Recorder, Sizes, read_rows, world_of_one_env  # noqa: E402

# name -> (function(rec, sizes), budget on the GPU in s, budget in the CPU dry run in s). Cheap checks first; the
# suite's total budget caps the last sections when earlier ones run long.
SECTIONS = {
    "bf16_vs_fp32": (correctness.bf16_vs_fp32, 30, 40),
    "meta_init": (correctness.meta_init, 30, 40),
    "checkpoint": (correctness.checkpoint, 35, 40),
    "adamw": (correctness.adamw, 30, 40),
    "moe": (correctness.moe, 30, 40),
    "ep_dispatch": (correctness.ep_dispatch, 20, 30),
    "memory": (memory.memory, 80, 70),
    "cp_kernels": (correctness.cp_kernels, 40, 60),
    "compile": (correctness.compile_regional, 75, 90),
    "throughput_1b": (throughput.throughput_1b, 130, 90),
    "throughput_3b": (throughput.throughput_3b, 80, 60),
    "front_ends": (front_ends.front_ends, 110, 120),
}
TOTAL_BUDGET_S = {False: 510, True: 215}  # GPU: <= 9 min with start-up and writing; dry run: <= 4 min
MIN_SECTION_S = 10  # less time than this left: the section is recorded as not run
RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU (gloo), tiny sizes; writes to a temp dir")
    ap.add_argument("--sections", help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    ap.add_argument("--out", help="directory for the JSON and markdown (default: benchmarks/results/gpu, or a "
                                  "temp dir with --dry-run)")
    ap.add_argument("--total-budget", type=float, help="seconds for the whole suite (default 510; dry run 215)")
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiply every time budget (a loaded or slow machine; the tests use it on shared CI)")
    ap.add_argument("--micro-batch-1b", type=int, default=4, help="rows per step of the 1B (seq 4096)")
    ap.add_argument("--micro-batch-3b", type=int, default=2, help="rows per step of the 3B")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length of throughput and front ends")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # worker: run one section
    ap.add_argument("--rows", help=argparse.SUPPRESS)  # worker: the JSON-lines file it appends to
    ap.add_argument("--sizes", help=argparse.SUPPRESS)  # worker: the driver's Sizes
    args = ap.parse_args(argv)
    chosen = args.sections.split(",") if args.sections else list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.chosen = chosen
    return args


# ---- the worker: one section in this process ---------------------------------------------------------------
def run_section(name: str, rows: str, sizes: Sizes) -> int:
    from gpu_sections.common import quiet

    quiet()
    rec = Recorder(rows, name)
    try:
        SECTIONS[name][0](rec, sizes)
    except Exception as exc:  # noqa: BLE001 - recorded as evidence; the driver goes on with the next section
        rec.add("section", "error", error=f"{type(exc).__name__}: {exc}"[:1500],
                traceback=traceback.format_exc()[-3000:])
        return 1
    return 0


# ---- the driver --------------------------------------------------------------------------------------------
def spawn(name: str, rows: Path, sizes: Sizes, budget: float) -> tuple[str, str]:
    """Run one section in its own process group under ``budget`` seconds: ("ok" | "error" | "timeout", stderr
    tail). A timeout kills the whole group (the front ends' own launches too)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--rows", str(rows),
           "--sizes", sizes.to_json()]
    proc = subprocess.Popen(cmd, env=world_of_one_env(sizes.dry_run), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", out[-3000:]
    return ("ok" if proc.returncode == 0 else "error"), out[-3000:]


def section_result(name: str, rows_file: Path, sizes: Sizes, budget: float) -> dict:
    start = time.perf_counter()
    status, log = spawn(name, rows_file, sizes, budget)
    rows = read_rows(rows_file)
    if status == "timeout":
        rows.append({"section": name, "name": "section", "status": "timeout",
                     "error": f"killed after its budget of {budget:.0f} s; the rows above are what it had",
                     "log_tail": log[-1500:]})
    elif status == "error" and not any(r["status"] == "error" for r in rows):  # died without a Python error
        rows.append({"section": name, "name": "section", "status": "error", "error": "the process died",
                     "log_tail": log[-1500:]})
    elif status == "ok" and not rows:
        rows.append({"section": name, "name": "section", "status": "error", "error": "no rows recorded"})
    return {"status": status, "budget_s": round(budget), "wall_s": round(time.perf_counter() - start, 1),
            "rows": rows}


def not_run(name: str) -> dict:
    row = {"section": name, "name": "section", "status": "timeout",
           "error": "not run: the suite's total time budget was spent"}
    return {"status": "timeout", "budget_s": 0, "wall_s": 0.0, "rows": [row]}


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = Sizes.dry() if args.dry_run else Sizes.gpu(args.micro_batch_1b, args.micro_batch_3b, args.seq)
    if args.section:
        return run_section(args.section, args.rows, Sizes.from_json(args.sizes) if args.sizes else sizes)
    return run_suite(args, sizes)


def run_suite(args, sizes: Sizes) -> int:
    from gpu_sections import report

    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="gpu_suite_dry_")) if args.dry_run
                                           else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    date, gpu = time.strftime("%Y-%m-%d"), report.gpu_name(args.dry_run)
    json_path = out / f"{date}-{report.slug(gpu)}.json"
    total = (args.total_budget or TOTAL_BUDGET_S[args.dry_run]) * args.budget_scale
    result = {"date": date, "gpu": gpu, "dry_run": args.dry_run, "versions": report.versions(),
              "commands": [" ".join(shlex.quote(a) for a in ["python", "benchmarks/gpu_suite.py",
                                                              *(argv_of(args))])],
              "sizes": sizes.__dict__, "total_budget_s": total, "sections": {}}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.chosen:
            _, gpu_budget, dry_budget = SECTIONS[name]
            left = total - (time.perf_counter() - start)
            budget = min((dry_budget if args.dry_run else gpu_budget) * args.budget_scale, left)
            print(f"gpu_suite: {name} (budget {budget:.0f} s)", flush=True)
            result["sections"][name] = (section_result(name, Path(tmp) / f"{name}.jsonl", sizes, budget)
                                        if budget >= MIN_SECTION_S else not_run(name))
            report.write(result, json_path)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    report.write(result, json_path)
    print(f"gpu_suite: {result['wall_s']} s; wrote {json_path} and {json_path.with_suffix('.md')}", flush=True)
    bad = [r for sec in result["sections"].values() for r in sec["rows"] if r["status"] in ("fail", "error",
                                                                                             "timeout")]
    return 1 if bad else 0


def argv_of(args) -> list[str]:
    """The options this run was given (for the command line in the report)."""
    out = ["--dry-run"] if args.dry_run else []
    if args.sections:
        out += ["--sections", args.sections]
    if args.out:
        out += ["--out", args.out]
    if args.budget_scale != 1.0:
        out += ["--budget-scale", f"{args.budget_scale:g}"]
    if not args.dry_run:
        out += ["--micro-batch-1b", str(args.micro_batch_1b), "--micro-batch-3b", str(args.micro_batch_3b),
                "--seq", str(args.seq)]
    return out


if __name__ == "__main__":
    sys.exit(main())

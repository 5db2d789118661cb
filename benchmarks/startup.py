"""Start-up time of a tiny run, phase by phase: from the command to the first optimizer step.

Runs ``ultrascale train --nproc 4 --set dp_shard=-1`` (issue 21, item 6) ``--runs`` times with
``ULTRASCALE_TIMINGS`` set, which makes the launcher and every worker append timing marks (JSON lines) to a file;
nothing else about the run changes. Each phase is the time between two marks on the critical path: for the
workers, between the moments the *last* rank passed each mark (a collective waits for the slowest rank), so the
phases add up to the time to the first step. In the same run, as a floor: ``python -c "import torch,
transformers"`` and the imports the launcher and a worker cannot do without, each timed inside a fresh
interpreter.

    python benchmarks/startup.py --runs 3 --out benchmarks/results/startup_after.json
    # the same, alternating run by run with another copy of the package (DIR/ultrascale_plugins, e.g. the tree
    # before a change, with the timing marks), so both see the same machine load:
    python benchmarks/startup.py --runs 3 --baseline DIR --baseline-label before \\
        --baseline-out benchmarks/results/startup_before.json --label after --out benchmarks/results/startup_after.json
    python benchmarks/startup.py --compare benchmarks/results/startup_before.json \\
        benchmarks/results/startup_after.json          # the README's table

The phases' medians are taken phase by phase, so they need not add up to the median time to the first step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

COMMAND = ["ultrascale", "train", "--nproc", "4", "--set", "dp_shard=-1"]

# (phase, process, from mark, to mark): "launcher" marks come from the process running the command, "worker"
# marks from the ranks (the latest rank's time of each mark); None: the benchmark's own clock at the start.
PHASES = [
    ("launcher: interpreter start", "launcher", None, "package_import"),
    ("launcher: imports", "launcher", "package_import", "cli_main"),
    ("launcher: recipe load", "launcher", "cli_main", "recipe_loaded"),
    ("launcher: pre-launch checks (meta model, validate, memory)", "launcher", "recipe_loaded", "checks_done"),
    ("launcher: data / tokenizer cache", "launcher", "checks_done", "data_prepared"),
    ("launcher: to spawn", "launcher", "data_prepared", "spawn"),
    ("torchrun: spawn until the last worker's Python starts", "worker", "spawn", "package_import"),
    ("worker: module imports", "worker", "package_import", "worker_main"),
    ("worker: recipe load", "worker", "worker_main", "worker_recipe"),
    ("worker: run's imports (transformers, engine)", "worker", "worker_recipe", "worker_imports"),
    ("worker: process group init", "worker", "worker_imports", "process_group"),
    ("worker: model build, validate, parallelize, init", "worker", "process_group", "model_built"),
    ("worker: optimizer, data, first line", "worker", "model_built", "loop_start"),
    ("worker: first step", "worker", "loop_start", "first_step"),
]
FIRST = "time to first step"
# after the first step (not start-up, shown so the whole command adds up)
AFTER = [
    ("after the first step: training steps 2..N", "worker", "first_step", "loop_done"),
    ("after the first step: validation, teardown", "worker", "loop_done", "run_done"),
    ("after the first step: worker exit until torchrun returns", "launcher", "run_done", "workers_exited"),
    ("after the first step: launcher exit", "launcher", "workers_exited", None),
]
TOTAL = "whole command"


def machine() -> dict:
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": model,
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": metadata.version("torch"), "transformers": metadata.version("transformers")}


def command() -> list[str]:
    exe = shutil.which("ultrascale") or os.path.join(os.path.dirname(sys.executable), "ultrascale")
    return [exe, *COMMAND[1:]]


def import_seconds(statement: str) -> float:
    """The seconds ``statement`` takes in a fresh interpreter, timed inside it (no interpreter start or exit)."""
    code = f"import time\nt = time.perf_counter()\n{statement}\nprint(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


FLOORS = {"import torch, transformers": "import torch, transformers",
          "import torch; from transformers import LlamaForCausalLM (what the launcher needs)":
              "import torch\nfrom transformers import LlamaForCausalLM",
          "the same + torch.distributed.fsdp, pipelining (what a worker needs)":
              "import torch, torch.distributed.fsdp, torch.distributed.pipelining\n"
              "from transformers import LlamaForCausalLM"}


def floors() -> dict:
    return {name: import_seconds(statement) for name, statement in FLOORS.items()}


DRY_RUN_CODE = """
import json, time, torch
from transformers import AutoConfig, AutoModelForCausalLM
from ultrascale_plugins.interface.config import ParallelConfig
from ultrascale_plugins.core.engine import validate
config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
layout, seconds = ParallelConfig(pp=2, tp=2, dp_shard=2), []
for _ in range(3):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    t = time.perf_counter()
    validate(layout, config, 8, model=model)
    seconds.append(time.perf_counter() - t)
print(json.dumps(seconds))
"""


def dry_run_cost(package_dir: str | None = None) -> dict:
    """What a worker no longer repeats on a larger model: ``engine.validate`` with a model (the meta-device dry
    runs of every plugin) on a 7 B Llama, pp=2 x tp=2 x dp_shard=2, three times in one process (the first pays
    the dry runs' own lazy imports)."""
    env = dict(os.environ)
    if package_dir:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(package_dir), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", DRY_RUN_CODE], check=True, capture_output=True, text=True,
                             env=env, cwd=tmp).stdout
    return {"model": "llama hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab 32000 (6.7 B), meta",
            "layout": "pp=2 x tp=2 x dp_shard=2, world 8", "validate_with_model_s": json.loads(out)}


def one_run(package_dir: str | None = None) -> dict:
    """One launch of the command; ``package_dir``: a directory holding another copy of ``ultrascale_plugins`` to
    run instead of the installed one (put first on PYTHONPATH; the command runs in a scratch directory, so the
    workers' ``python -m`` does not pick up a checkout in the current directory)."""
    with tempfile.TemporaryDirectory(prefix="ultrascale-startup-") as tmp:
        marks_path = os.path.join(tmp, "timings.jsonl")
        env = {**os.environ, "ULTRASCALE_TIMINGS": marks_path}
        if package_dir:
            env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(package_dir), *filter(None, [env.get("PYTHONPATH")])])
        load_before = os.getloadavg()
        t0 = time.time()
        proc = subprocess.run(command(), env=env, capture_output=True, text=True, cwd=tmp)
        t_end = time.time()
        if proc.returncode:
            sys.exit(f"the command failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        marks = [json.loads(line) for line in open(marks_path)]
    launcher = {m["phase"]: m["t"] for m in marks if m["rank"] is None and m["phase"] != "package_import"}
    launcher_pid = next(m["pid"] for m in marks if m["rank"] is None and m["phase"] == "cli_main")
    launcher["package_import"] = next(m["t"] for m in marks if m["pid"] == launcher_pid
                                      and m["phase"] == "package_import")
    launcher_cpu = {m["phase"]: m["cpu"] for m in marks if m["pid"] == launcher_pid}
    ranks: dict[str, dict] = {}
    ranks_cpu: dict[str, dict] = {}
    for m in marks:
        if m["rank"] is not None:
            ranks.setdefault(m["rank"], {}).setdefault(m["phase"], m["t"])
            ranks_cpu.setdefault(m["rank"], {}).setdefault(m["phase"], m["cpu"])
    latest = {name: max(r[name] for r in ranks.values()) for name in ranks["0"]}
    phases = {}
    for name, where, start, end in PHASES:
        a = t0 if start is None else (launcher[start] if where == "launcher" or start == "spawn" else latest[start])
        b = launcher[end] if where == "launcher" else latest[end]
        phases[name] = b - a
    phases[FIRST] = latest["first_step"] - t0
    for name, where, start, end in AFTER:
        a = latest[start] if start in latest else launcher[start]
        phases[name] = (t_end if end is None else launcher[end] if where == "launcher" else latest[end]) - a
    phases[TOTAL] = t_end - t0
    # CPU seconds each phase used: the launcher's own, or the sum over the ranks (torchrun's process is not marked)
    cpu = {}
    for name, where, start, end in PHASES:
        if where == "launcher":
            cpu[name] = launcher_cpu[end] - (launcher_cpu[start] if start else 0.0)
        else:
            cpu[name] = sum(v[end] - (0.0 if start == "spawn" else v[start]) for v in ranks_cpu.values())
    cpu[FIRST + " (launcher + workers)"] = launcher_cpu["spawn"] + sum(v["first_step"] for v in ranks_cpu.values())
    train_s = re.search(r"tok/s, ([0-9.]+)s\n", proc.stdout)
    per_rank = {r: {name: v[end] - v[start] for name, where, start, end in PHASES
                    if where == "worker" and start in v and end in v}
                for r, v in sorted(ranks.items())}
    return {"phases_s": phases, "cpu_s": cpu,
            "training_loop_s (as printed)": float(train_s.group(1)) if train_s else None,
            "worker_processes": len(ranks), "per_rank_s": per_rank,
            "loadavg_1m_before": load_before[0], "loadavg_1m_after": os.getloadavg()[0], "floors_s": floors()}


def median_of(runs: list[dict], key: str) -> dict:
    names = runs[0][key].keys()
    return {n: round(statistics.median(r[key][n] for r in runs), 3) for n in names}


def compare(before_path: str, after_path: str) -> None:
    before, after = json.load(open(before_path)), json.load(open(after_path))
    print("| phase | before: wall (s) | after: wall (s) | before: CPU (s) | after: CPU (s) |")
    print("| --- | --- | --- | --- | --- |")
    bw, aw = before["median"]["phases_s"], after["median"]["phases_s"]
    bc, ac = before["median"]["cpu_s"], after["median"]["cpu_s"]
    for name in bw:
        strong = "**" if name in (FIRST, TOTAL) else ""
        cpu = [f"{c[name]:.2f}" if name in c else "" for c in (bc, ac)]
        print(f"| {strong}{name}{strong} | {strong}{bw[name]:.2f}{strong} | {strong}{aw[name]:.2f}{strong} | "
              f"{cpu[0]} | {cpu[1]} |")
    key = FIRST + " (launcher + workers)"
    print(f"| CPU seconds to the first step (launcher + workers) | | | {bc[key]:.2f} | {ac[key]:.2f} |")
    for name in before["median"]["floors_s"]:
        print(f"| floor: `{name}` | {before['median']['floors_s'][name]:.2f} | "
              f"{after['median']['floors_s'][name]:.2f} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="write the runs and their medians as JSON here")
    parser.add_argument("--label", default="", help="a note kept in the JSON (e.g. before / after)")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also run, alternating with the installed package, the copy of ultrascale_plugins in "
                             "DIR (e.g. the tree before a change), so machine noise hits both alike")
    parser.add_argument("--baseline-out", help="where the baseline's runs and medians go (JSON)")
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="print a markdown table of two results' medians and exit")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    variants = ([(args.baseline_label, args.baseline, args.baseline_out)] if args.baseline else []) + [
        (args.label or "current", None, args.out)]
    runs: dict = {label: [] for label, _, _ in variants}
    for i in range(args.runs):
        for label, package_dir, _ in variants:  # alternating: each pair of runs sees the same machine load
            runs[label].append(one_run(package_dir))
            p = runs[label][-1]["phases_s"]
            print(f"{label}: run {i + 1}/{args.runs}: first step at {p[FIRST]:.2f}s, whole command {p[TOTAL]:.2f}s "
                  f"(load {runs[label][-1]['loadavg_1m_before']:.2f})", flush=True)
    dry_runs = dry_run_cost()
    seconds = ", ".join(f"{s:.2f}" for s in dry_runs["validate_with_model_s"])
    print(f"the meta-device dry runs a worker no longer repeats, 7 B Llama: {seconds} s")
    for label, package_dir, out in variants:
        write(label, package_dir, runs[label], out, args.baseline is not None, dry_runs)


def write(label: str, package_dir: str | None, runs: list[dict], out: str | None, alternated: bool,
          dry_runs: dict) -> None:
    result = {"label": label, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(COMMAND), "package": package_dir or "installed", "alternated_with_baseline":
              alternated, "machine": machine(), "meta_dry_runs": dry_runs, "runs": runs,
              "median": {"phases_s": median_of(runs, "phases_s"), "cpu_s": median_of(runs, "cpu_s"),
                         "floors_s": median_of(runs, "floors_s")}}
    print(f"== {label}: median of {len(runs)} runs")
    width = max(len(n) for n in result["median"]["phases_s"])
    print(f"{'phase':<{width}}  {'wall':>7}  {'CPU':>7}")
    for name, value in result["median"]["phases_s"].items():
        c = result["median"]["cpu_s"].get(name)
        print(f"{name:<{width}}  {value:7.2f}  " + (f"{c:7.2f}" if c is not None else ""))
    c = result["median"]["cpu_s"][FIRST + " (launcher + workers)"]
    print(f"CPU seconds to the first step (launcher + workers, torchrun not counted): {c:.2f}")
    for name, value in result["median"]["floors_s"].items():
        print(f"floor {name}: {value:.2f} s")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The planner's live bytes per rank (``Estimate.total_memory``: before the allocator's ``fragmentation`` and
``memory_overhead_gb``) against the dry run's peak at full size, by category (issue 49: "The planner held to it at
full size"): the memory rows of docs/performance.md and docs/planner.md the dry run runs, the nearest layout it
runs for those it does not, and layouts from 8 to 1,024 ranks.

    nohup python benchmarks/dry_run_vs_planner.py > /tmp/dry_run_vs_planner.log &   # ~15 min on 2 cores
    python benchmarks/dry_run_vs_planner.py --only "70B TP 8 x dp 8"                # some rows, printed only

Writes benchmarks/results/dry_run_vs_planner.json and .md. Each dry run is one optimizer step of the package's
code on fake tensors (``us.dry_run``), in this process; its time is in the row. A layout is one line of ``ROWS``;
a documented row the dry run does not run yet is one line of ``NOT_RUN`` with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ultrascale_plugins as us  # noqa: E402
from ultrascale_plugins.planner.model_spec import load_model_config  # noqa: E402

MB = 2**20
TOLERANCE_PCT = 10.0  # the bar: the planner's live bytes within 10 % of the dry run's
CATEGORIES = ("params", "grads", "optimizer", "activations", "other", "total")


@dataclasses.dataclass(frozen=True)
class Row:
    """One layout: a name, the preset, the ranks, tokens per row and rows per micro-batch, ``ParallelConfig``
    fields (bf16 compute unless said), and where it comes from."""

    name: str
    model: str
    world: int
    seq_len: int
    mbs: int
    layout: dict
    source: str = "chosen here"


def bf16(**fields) -> dict:
    return {"mixed_precision": "bf16", **fields}


L1, L8, L70, L405 = "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b"
FULL = "full"
ROWS = [  # the quick ones first: each row is written as it finishes
    Row("1B ZeRO-1 x 8", L1, 8, 4096, 1, bf16(dp_shard=8, zero_stage=1)),
    Row("1B DDP x 16", L1, 16, 2048, 1, bf16(dp_replicate=16, dp_shard=1, zero_stage=0)),
    Row("8B ZeRO-2 x 8, mbs 2", L8, 8, 4096, 2, bf16(dp_shard=8, zero_stage=2)),
    Row("8B ZeRO-3 x 8, full recomputation, mbs 2", L8, 8, 4096, 2, bf16(dp_shard=8, activation_checkpointing=FULL)),
    Row("8B TP 8 x dp 4 ZeRO-3", L8, 32, 4096, 1, bf16(dp_shard=4, tp=8, sequence_parallel=True)),
    Row("8B TP 8 x dp 128 ZeRO-3, full recomputation", L8, 1024, 4096, 1,
        bf16(dp_shard=128, tp=8, sequence_parallel=True, activation_checkpointing=FULL)),
    Row("8B full, 1 rank, bf16 states, without offload or the chunked loss", L8, 1, 4096, 1,
        dict(dp_shard=1, param_dtype="bf16", activation_checkpointing=FULL),
        "performance.md 8B full on 1 x 24 GB, the nearest it runs"),
    Row("70B TP 8 x dp 8 ZeRO-3", L70, 64, 4096, 1, bf16(dp_shard=8, tp=8, sequence_parallel=True),
        "planner.md dry run"),
    Row("70B ZeRO-3 x 64", L70, 64, 4096, 1, bf16(dp_shard=64), "planner.md dry run"),
    Row("70B full, 8 ranks, without offload or the chunked loss", L70, 8, 4096, 4,
        bf16(dp_shard=8, activation_checkpointing=FULL), "performance.md 70B full on 8 x 80 GB, the nearest it runs"),
    Row("70B TP 8 x dp 16 ZeRO-3, full recomputation, mbs 2", L70, 128, 4096, 2,
        bf16(dp_shard=16, tp=8, sequence_parallel=True, activation_checkpointing=FULL)),
    Row("405B TP 8 x dp 64 ZeRO-3, full recomputation", L405, 512, 4096, 1,
        bf16(dp_shard=64, tp=8, sequence_parallel=True, activation_checkpointing=FULL)),
]
NOT_RUN = [  # documented memory rows the dry run does not run yet: (row, source, why)
    ("70B full on 8 x 80 GB as planned (states offloaded, the chunked loss)", "performance.md",
     "cpu_offload and chunked_loss are refused by the dry run"),
    ("8B full on 1 x 24 GB as planned (bf16 states offloaded, the chunked loss)", "performance.md",
     "cpu_offload and chunked_loss are refused by the dry run"),
    ("70B LoRA r=16 on 8 x 80 GB (dp 4 x tp 2, and dp 8)", "performance.md", "--peft: not run yet"),
    ("70B QLoRA r=16 on 2 x 24 GB", "performance.md", "--peft qlora: not run yet"),
    ("Qwen3-30B-A3B with EP", "issue 49", "ep: not run yet"),
    ("DDP and ZeRO-1 at 8B and above", "chosen here", "the dry run allocates one real fp32 copy of the model "
     "(32 GB at 8B) under DDP's reducer, more than this machine's 23 GB; run at 1B"),
    ("Frontier 22B (dp 2, pp 8, ZeRO-1)", "planner.md", "pp: not run yet"),
    ("Frontier 175B (dp 2, tp 4, pp 16, ZeRO-1)", "planner.md", "pp: not run yet"),
    ("Frontier 1T (dp 2, tp 4, pp 128, ZeRO-1)", "planner.md", "pp: not run yet"),
]


def compare(row: Row) -> dict:
    """The dry run of ``row`` and the planner's estimate beside it, by category: bytes and diff % (planner vs dry)."""
    config = load_model_config(row.model)
    report = us.dry_run(config, us.ParallelConfig(**row.layout), world_size=row.world, seq_len=row.seq_len,
                        micro_batch_size=row.mbs)
    role = report.roles[0]
    dry, est = role.memory(), role.estimate_memory
    by = {name: {"dry_run": dry.get(name, 0), "planner": int(est.get(name, 0)),
                 "diff_pct": _diff(est.get(name, 0), dry.get(name, 0))} for name in CATEGORIES}
    return {**dataclasses.asdict(row), "seconds": round(report.seconds, 1), "peak_where": role.peak_where,
            "by_category": by, "diff_pct": by["total"]["diff_pct"]}


def _diff(est: float, dry: float):
    return None if dry < 2**20 else round(100 * (est - dry) / dry, 1)


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| layout | ranks | tokens x rows | dry run MB (activations) | planner MB (activations) | "
             "diff % total (activations) | peak at | s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r.get('world', '')} | | not run: {r['error']} | | | | |")
            continue
        t, a = r["by_category"]["total"], r["by_category"]["activations"]
        lines.append(f"| {r['name']} | {r['world']} | {r['seq_len']} x {r['mbs']} | {t['dry_run'] / MB:,.0f} "
                     f"({a['dry_run'] / MB:,.0f}) | {t['planner'] / MB:,.0f} ({a['planner'] / MB:,.0f}) | "
                     f"{_pct(t['diff_pct'])} ({_pct(a['diff_pct'])}) | {r['peak_where']} | {r['seconds']:.0f} |")
    for name, source, why in NOT_RUN:
        lines.append(f"| {name} ({source}) | | | not run yet: {why} | | | | |")
    return "\n".join(lines) + "\n"


def _pct(value) -> str:
    return "" if value is None else f"{value:+.1f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of ROWS (case-insensitive prefixes); printed, not written")
    args = parser.parse_args(argv)
    wanted = [n.lower() for n in args.only or ()]
    rows = []
    for row in ROWS:
        if wanted and not any(row.name.lower().startswith(n) for n in wanted):
            continue
        try:
            rows.append(compare(row))
        except Exception as exc:  # noqa: BLE001 - a row that does not run says why
            rows.append({**dataclasses.asdict(row), "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
        print(markdown(rows[-1:], row.name).splitlines()[4], flush=True)
        if not args.only:
            _write(rows)
    if not args.only:
        print(markdown(rows, _header()))


def _header() -> str:
    return (f"Per rank, bf16 compute, AdamW, clipping; the planner before its allocator terms; "
            f"{datetime.date.today().isoformat()}, torch {torch.__version__}, {os.cpu_count()} cores")


def _write(rows: list[dict]) -> None:
    """The rows so far, as JSON and markdown under benchmarks/results/ (a long run leaves what it finished)."""
    table = markdown(rows, _header())
    out = ROOT / "benchmarks" / "results" / "dry_run_vs_planner"
    meta = {"command": "python benchmarks/dry_run_vs_planner.py", "header": _header(), "tolerance_pct": TOLERANCE_PCT,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "not_run": [dict(zip(("name", "source", "why"), r)) for r in NOT_RUN]}
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()

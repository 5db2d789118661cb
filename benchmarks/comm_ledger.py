"""The communication ledger over the layouts of issue 33's "Done when": for each, one optimizer step recorded on
every rank (``ParallelModel.profile_step``), its bytes per mesh axis beside the package's estimate and the layout's
minimum. A layout the engine refuses today is recorded with the one line it refuses with.

    python benchmarks/comm_ledger.py                      # every layout: one launch per world size
    python benchmarks/comm_ledger.py --only tp2 zero3_m1  # some of them

Writes benchmarks/results/comm_ledger.json and benchmarks/results/comm_ledger.md (the table docs/performance.md
shows). To add a layout, add a line to LAYOUTS: (name, world size, layout, micro-batches accumulated per step,
model, options). The flight recorder is switched on, so each row also says whether torch's own count agrees.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SEQ, ROWS = 32, 2  # tokens per row, rows per micro-batch on each data-parallel rank

# (name, world, layout, micro-batches accumulated per step, model in tests/models.py, options: {"lora": True})
LAYOUTS = [
    ("tp2", 2, {"tp": 2, "dp_shard": 1}, 1, "llama", {}),
    ("tp2_sp", 2, {"tp": 2, "sequence_parallel": True, "dp_shard": 1}, 1, "llama", {}),
    *[(f"zero{z}_m{m}", 2, {"dp_shard": 2, "zero_stage": z}, m, "llama", {}) for z in (1, 2, 3) for m in (1, 4)],
    ("ddp_tp2", 4, {"dp_shard": 2, "zero_stage": 0, "tp": 2}, 1, "llama", {}),
    ("zero1_tp2_sp", 4, {"dp_shard": 2, "zero_stage": 1, "tp": 2, "sequence_parallel": True}, 1, "llama", {}),
    ("zero2_tp2_sp", 4, {"dp_shard": 2, "zero_stage": 2, "tp": 2, "sequence_parallel": True}, 1, "llama", {}),
    ("zero3_tp2_sp", 4, {"dp_shard": 2, "zero_stage": 3, "tp": 2, "sequence_parallel": True}, 1, "llama", {}),
    ("pp2_zero1_m8", 4, {"pp": 2, "dp_shard": 2, "zero_stage": 1, "pp_microbatches": 8}, 1, "llama", {}),
    ("pp2_zero3_m8", 4, {"pp": 2, "dp_shard": 2, "zero_stage": 3, "pp_microbatches": 8}, 1, "llama", {}),
    ("cp2_ring", 2, {"cp": 2, "cp_method": "ring", "dp_shard": 1}, 1, "llama", {}),
    ("cp2_ulysses", 2, {"cp": 2, "cp_method": "ulysses", "dp_shard": 1}, 1, "llama", {}),
    ("ep2", 2, {"dp_shard": 2, "ep": 2}, 1, "qwen3_moe", {}),
    ("lora_tp2_sp", 2, {"tp": 2, "sequence_parallel": True, "dp_shard": 1}, 1, "llama", {"lora": True}),
]


def build_model(arch: str, lora: bool):
    sys.path.insert(0, str(ROOT / "tests"))
    from models import make_model

    model = make_model(arch)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    return model


def batch_for(pmodel, micro_batches: int) -> list[dict]:
    """This rank's micro-batches of one step: ROWS rows of SEQ tokens each (a pipeline splits its batch further)."""
    import torch

    rows = ROWS * (pmodel.config.pp_microbatches if pmodel.config.pp > 1 else 1)
    g = torch.Generator().manual_seed(pmodel.data_parallel_rank)
    return [{"input_ids": (ids := torch.randint(0, 256, (rows, SEQ), generator=g)), "labels": ids.clone()}
            for _ in range(micro_batches)]


def one_step(pmodel, optimizer, chunks: list[dict]) -> None:
    """An optimizer step as ``ultrascale train`` runs it: accumulation under ``no_sync``, clipping, AdamW."""
    import contextlib

    shares = pmodel.token_shares(chunks)
    for i, chunk in enumerate(chunks):
        with contextlib.nullcontext() if i == len(chunks) - 1 else pmodel.no_sync():
            pmodel.train_step(chunk, loss_scale=shares[i])
    pmodel.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_layout(name: str, world: int, layout: dict, micro_batches: int, arch: str, options: dict) -> dict:
    import torch
    import torch.distributed as dist

    import ultrascale_plugins as us
    from ultrascale_plugins.interface.fields import ConfigError

    row = {"name": name, "world": world, "layout": layout, "micro_batches": micro_batches, "model": arch,
           **options, "command": f"python benchmarks/comm_ledger.py --only {name}"}
    try:
        pmodel = us.parallelize(build_model(arch, options.get("lora", False)), us.ParallelConfig(**layout))
    except ConfigError as exc:  # refused before any collective, the same on every rank
        return {**row, "refused": str(exc)}
    optimizer = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3)
    chunks = batch_for(pmodel, micro_batches)
    one_step(pmodel, optimizer, chunks)  # the first step also builds what later steps reuse
    with pmodel.profile_step(out=print if dist.get_rank() == 0 else None) as profile:
        one_step(pmodel, optimizer, chunks)
    return {**row, "layout_resolved": pmodel.dims.describe(), "step": profile.step, "rows": profile.rows,
            "flight_recorder": profile.flight_recorder, "table": profile.table}


def worker(out: str, names: list[str]) -> None:
    import torch.distributed as dist

    import ultrascale_plugins as us

    us.init_distributed(timeout=300)
    results = [run_layout(*entry) for entry in LAYOUTS if entry[0] in names]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1, default=str))
    dist.destroy_process_group()


def launch(world: int, names: list[str], out: str) -> None:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "20000", "PYTHONPATH": f"{ROOT}{os.pathsep}"
           + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                    __file__, "--worker", out, *names], check=True, env=env)


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def markdown(results: list[dict]) -> str:
    """The table docs/performance.md shows: per layout and axis, measured / estimate / minimum payload."""
    from ultrascale_plugins.comm_report import human

    lines = ["| layout | axis | op | calls | measured payload | wire | estimate | minimum | measured / minimum | "
             "estimate / measured | command |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        command = f"`{r['command']}`"
        if "refused" in r:
            lines.append(f"| {r['name']} | refused: {r['refused']} | | | | | | | | | {command} |")
            continue
        for row in (x for x in r["rows"] if not x["small"]):
            est = row["estimate"]["payload"] if row["estimate"] else 0
            low = row["minimum"]["payload"] if row["minimum"] else 0
            lines.append(f"| {r['name']} | {row['axis']} | {row['op']} | {row['calls']} | {human(row['payload'])} | "
                         f"{human(row['wire'])} | {human(est) if row['estimate'] else '-'} | "
                         f"{human(low) if row['minimum'] else '-'} | {ratio(row['payload'], low)} | "
                         f"{ratio(est, row['payload'])} | {command} |")
        small = sum(x["calls"] for x in r["rows"] if x["small"])
        differ = r["flight_recorder"].get("differ")
        fr = "agrees" if differ == {} else f"differs: {differ}" if differ else "off"
        lines.append(f"| {r['name']} | scalar exchanges | | {small} | | | | | | | flight recorder {fr} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="layout names (default: every one in LAYOUTS)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1:])
        return
    names = args.only or [entry[0] for entry in LAYOUTS]
    unknown = sorted(set(names) - {entry[0] for entry in LAYOUTS})
    if unknown:
        sys.exit(f"--only {' '.join(unknown)}: not in LAYOUTS. Fix: one of {', '.join(e[0] for e in LAYOUTS)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({e[1] for e in LAYOUTS if e[0] in names}):
            out = os.path.join(tmp, f"world{world}.json")
            launch(world, [e[0] for e in LAYOUTS if e[0] in names and e[1] == world], out)
            results += json.loads(Path(out).read_text())
    order = [e[0] for e in LAYOUTS]
    results.sort(key=lambda r: order.index(r["name"]))
    import torch

    record = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPU "
              f"cores, gloo", "torch": torch.__version__, "seq_len": SEQ, "rows_per_micro_batch": ROWS,
              "units": "bytes per rank per optimizer step, the most loaded rank per row", "layouts": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "" if not args.only else "_" + "_".join(names)
    (RESULTS / f"comm_ledger{suffix}.json").write_text(json.dumps(record, indent=1, default=str))
    (RESULTS / f"comm_ledger{suffix}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()

"""The communication ledger over the layouts of issue 33's "Done when": for each, one optimizer step recorded on
every rank (``ParallelModel.profile_step``), its bytes per mesh axis beside the package's estimate and the layout's
minimum. A layout the engine refuses today is recorded with the one line it refuses with.

    python benchmarks/comm_ledger.py                      # every layout: one launch per world size
    python benchmarks/comm_ledger.py --only tp2 zero3_m1  # some of them: printed, no file written

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
    ("tp2_sp_chunked", 2, {"tp": 2, "sequence_parallel": True, "dp_shard": 1, "chunked_loss": 16}, 1, "llama", {}),
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

    shares = pmodel.tokens.shares(chunks)
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


def _figures(row: dict) -> str:
    from ultrascale_plugins.core.comm_report import human

    est, low = row["estimate"] or {}, row["minimum"] or {}
    return (f"{human(row['payload'])} | {human(row['wire'])} | {human(est['payload']) if est else '-'} | "
            f"{human(low['payload']) if low else '-'} | {ratio(row['payload'], low.get('payload'))} | "
            f"{ratio(row['wire'], low.get('wire'))} | {ratio(est.get('payload'), row['payload'])}")


def markdown(results: list[dict], per_op: bool = False) -> str:
    """Per layout and mesh axis (``per_op``: and collective), the measured payload and wire bytes beside the
    estimate and the minimum; the table docs/performance.md shows is the per-axis one."""
    from ultrascale_plugins.core.comm_report import axis_totals

    lines = [f"| layout | axis | {'op | calls' if per_op else 'calls'} | measured payload | wire | estimate | "
             "minimum | measured / minimum | wire: measured / minimum | estimate / measured | command |",
             "| --- " * (12 if per_op else 11) + "|"]
    for r in results:
        command = f"`{r['command']}`"
        if "refused" in r:
            lines.append(f"| {r['name']} | refused: {r['refused']} |{' |' * (9 if per_op else 8)} {command} |")
            continue
        if per_op:
            for row in (x for x in r["rows"] if not x["small"]):
                lines.append(f"| {r['name']} | {row['axis']} | {row['op']} | {row['calls']} | {_figures(row)} | "
                             f"{command} |")
        else:
            for total in axis_totals(r["rows"], least=1):
                calls = ", ".join(f"{x['calls']} {x['op']}" for x in r["rows"]
                                  if x["axis"] == total["axis"] and not x["small"] and x["calls"])
                lines.append(f"| {r['name']} | {total['axis']} | {calls or 0} | {_figures(total)} | {command} |")
        small = sum(x["calls"] for x in r["rows"] if x["small"])
        differ = r["flight_recorder"].get("differ")
        fr = "agrees" if differ == {} else f"differs: {differ}" if differ else "off"
        lines.append(f"| {r['name']} | scalar exchanges |{' |' * (1 if per_op else 0)} {small} |"
                     f"{' |' * 7} flight recorder {fr} |")
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
    print(markdown(results, per_op=True))
    if not args.only:  # the record is of every layout; --only prints its rows
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "comm_ledger.json").write_text(json.dumps(record, indent=1, default=str))
        (RESULTS / "comm_ledger.md").write_text("Per mesh axis:\n\n" + markdown(results) + "\nPer collective:\n\n"
                                                + markdown(results, per_op=True))


if __name__ == "__main__":
    main()

"""The dry run's peak live bytes per rank against the measured peak of the same step run for real, under the same
tracker (torch's ``MemTracker``), one row per layout the dry run runs (issue 49: "Proven against real runs").

    python benchmarks/dry_run_vs_real.py                  # every layout; writes benchmarks/results/dry_run_vs_real.*
    python benchmarks/dry_run_vs_real.py --only ddp zero3 # some rows, printed only

The real step runs in ``world`` gloo processes on this machine (``compare``): the model built on the meta device,
``parallelize``, one warm-up AdamW step on zero gradients (the optimizer's states exist, as in the dry run), then
one tracked step, ``train_step``, gradient clipping and AdamW, as ``us.dry_run`` runs it on fake tensors.
gloo's reduce-scatter holds a copy of its whole input while it runs where NCCL's (which the dry run stands for)
holds none: FSDP's reduce-scatter is replaced by an in-place all-reduce that holds no more than NCCL
(``reduce_scatter_without_a_copy``). A layout is one line of ``LAYOUTS``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ultrascale_plugins as us  # noqa: E402

MB = 2**20
TOLERANCE_PCT = 5.0  # the bar: the dry run's peak within 5 % of the real step's


def model_config(hidden=1024, layers=12, vocab=32000, intermediate=2816, heads=16, kv_heads=4):
    """A Llama from its sizes (default: 0.2B parameters, 32,000-token vocabulary)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One row: a name, the processes it runs on, and the ``ParallelConfig`` fields of its layout."""

    name: str
    world: int
    layout: dict


BF16 = dict(mixed_precision="bf16")
LAYOUTS = [
    Cell("DDP", 2, dict(dp_replicate=2, dp_shard=1, zero_stage=0, **BF16)),
    Cell("ZeRO-1", 2, dict(dp_shard=2, zero_stage=1, **BF16)),
    Cell("ZeRO-2", 2, dict(dp_shard=2, zero_stage=2, **BF16)),
    Cell("ZeRO-3", 2, dict(dp_shard=2, zero_stage=3, **BF16)),
    Cell("TP 2 + SP", 2, dict(dp_shard=1, tp=2, sequence_parallel=True, **BF16)),
    Cell("TP 2 x ZeRO-3", 4, dict(dp_shard=2, tp=2, sequence_parallel=True, **BF16)),
    Cell("ZeRO-3 + full recomputation", 2, dict(dp_shard=2, activation_checkpointing="full", **BF16)),
    Cell("CP 2 ring", 2, dict(dp_shard=1, cp=2, cp_method="ring", **BF16)),
    Cell("CP 2 Ulysses", 2, dict(dp_shard=1, cp=2, cp_method="ulysses", **BF16)),
    Cell("ZeRO-3 + states offloaded", 2, dict(dp_shard=2, cpu_offload=True, **BF16)),
    Cell("ZeRO-3 + the chunked loss", 2, dict(dp_shard=2, chunked_loss=4, **BF16)),
]


def reduce_scatter_without_a_copy(pmodel) -> None:
    """FSDP's reduce-scatter as NCCL's holds it, which the dry run stands for: gloo's holds a copy of its whole
    input while it runs (MemTracker counts it); an all-reduce in place (gloo makes none) and this rank's part
    copied out hold no more than NCCL."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class InPlace(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)])

    for module in pmodel.module.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(InPlace())


def real_step_peak(config, layout, seq_len, prepare=None, where: list | None = None) -> dict:
    """MemTracker's peak by category over one real step of ``layout`` (the process group initialized), warmed up
    and tracked as the dry run's step is; ``prepare(pmodel)`` runs after ``parallelize``; where the peak fell is
    appended to ``where`` when one is given."""
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.core.fake_run import peak_tracker

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    pmodel = us.parallelize(model, layout, device=torch.device("cpu"))
    if prepare is not None:
        prepare(pmodel)
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-4)
    for param in pmodel.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    opt.zero_grad()
    torch.manual_seed(0)  # the same rows on every rank, as the dry run's
    batch = {"input_ids": torch.randint(0, config.vocab_size, (1, seq_len))}  # made before the step, as there
    tracker = peak_tracker()
    inner = getattr(opt, "optim", None)  # ZeRO-1's ZeroRedundancyOptimizer keeps its states in its local one
    tracker.track_external(*pmodel.modules, opt, *([inner] if isinstance(inner, torch.optim.Optimizer) else []))
    with tracker:  # the phases named as the dry run names them, for a peak outside every module
        tracker.phase = "forward and backward (the loss)"
        pmodel.train_step(batch)
        tracker.phase = "gradient clipping"
        pmodel.clip_grad_norm_(1.0)
        tracker.phase = "optimizer step"
        opt.step()
        opt.zero_grad()
    if where is not None:
        where.append(tracker.peak_where)
    return {getattr(k, "value", k): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}


def _worker(rank: int, world: int, init: str, out: str, config, layout: dict, seq_len: int) -> None:
    """One real rank: its peak written to ``out``.rank.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        where: list = []
        peak = real_step_peak(config, us.ParallelConfig(**layout), seq_len, reduce_scatter_without_a_copy, where)
        Path(f"{out}.{rank}.json").write_text(json.dumps({"peak": peak, "where": where[0]}))
    finally:
        dist.destroy_process_group()


def real_peaks(config, layout: dict, world: int, seq_len: int) -> list[dict]:
    """Every rank's ``real_step_peak`` over ``world`` gloo processes; rank 0 first."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peak")
        mp.start_processes(_worker, args=(world, f"file://{tmp}/store", out, config, layout, seq_len), nprocs=world,
                           join=True, start_method="spawn")
        return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(world)]


def compare(config, layout: dict, world: int, seq_len: int) -> dict:
    """The dry run's peak for rank 0 beside each real rank's: bytes by category, where, diff % (dry vs real)."""
    start = time.perf_counter()
    role = us.dry_run(config, us.ParallelConfig(**layout), world_size=world, seq_len=seq_len).roles[0]
    dry_s = time.perf_counter() - start
    start = time.perf_counter()
    reals = real_peaks(config, layout, world, seq_len)
    real_s = time.perf_counter() - start
    dry, real = role.peak["Total"], reals[0]["peak"]["Total"]
    worst = max(abs(r["peak"]["Total"] - dry) / r["peak"]["Total"] for r in reals)
    return {"world": world, "layout": layout, "seq_len": seq_len, "dry_peak": role.peak, "dry_where": role.peak_where,
            "real_peak": reals[0]["peak"], "real_where": reals[0]["where"],
            "real_totals_by_rank": [r["peak"]["Total"] for r in reals], "dry_total": dry, "real_total": real,
            "diff_pct": round(100 * (dry - real) / real, 3), "worst_rank_diff_pct": round(100 * worst, 3),
            "dry_s": round(dry_s, 1), "real_s": round(real_s, 1)}


def _row(cell: Cell, config, seq_len: int) -> dict:
    try:
        return {"name": cell.name, **compare(config, cell.layout, cell.world, seq_len)}
    except Exception as exc:  # noqa: BLE001 - a layout the dry run cannot run is a row that says why
        return {"name": cell.name, "world": cell.world, "layout": cell.layout, "seq_len": seq_len,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| layout | world | dry-run peak MB | real peak MB | diff % | where (dry run / real) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['world']} | not run: {r['error']} | | | |")
            continue
        where = r["dry_where"] if r["dry_where"] == r["real_where"] else f"{r['dry_where']} / {r['real_where']}"
        lines.append(f"| {r['name']} | {r['world']} | {r['dry_total'] / MB:,.1f} | {r['real_total'] / MB:,.1f} | "
                     f"{r['diff_pct']:+.2f} | {where} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of LAYOUTS rows (case-insensitive); printed, not written")
    parser.add_argument("--merge", action="store_true", help="with --only: write those rows into the committed "
                        "results in LAYOUTS' order, the other rows kept as they were measured")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args(argv)
    config = model_config()
    cells = [c for c in LAYOUTS if not args.only or c.name.lower() in {n.lower() for n in args.only}]
    params = sum(p.numel() for p in _meta_model(config).parameters())
    header = (f"Llama {params / 1e9:.2f}B (hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocabulary "
              f"{config.vocab_size:,}), 1 x {args.seq_len} tokens per rank, bf16 compute, AdamW, clipping; "
              f"{datetime.date.today().isoformat()}, torch {torch.__version__}, {os.cpu_count()} cores, gloo")
    rows = []
    for cell in cells:
        rows.append(_row(cell, config, args.seq_len))
        print(markdown(rows[-1:], cell.name).splitlines()[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "dry_run_vs_real"
    if args.only and args.merge:  # the committed rows, these replacing or joining them, in LAYOUTS' order
        kept = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
        kept.update({r["name"]: r for r in rows})
        rows = [kept[c.name] for c in LAYOUTS if c.name in kept]
    table = markdown(rows, header)
    print(table)
    if args.only and not args.merge:
        return
    meta = {"command": "python benchmarks/dry_run_vs_real.py", "header": header, "tolerance_pct": TOLERANCE_PCT,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"}
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


if __name__ == "__main__":
    main()

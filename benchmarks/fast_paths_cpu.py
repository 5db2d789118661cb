"""The fast paths on CPU, each against its baseline in the same run: regional compilation vs eager (step time and
compile time), explicit FSDP2 prefetch vs FSDP2's default, and an asynchronous checkpoint save vs a blocking one
(the steps' wall time around a save).

Each pair's runs alternate (a, b, a, b, ...) so machine noise hits both alike; times are medians.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/fast_paths_cpu.py \
        --out benchmarks/results/fast_paths_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import ultrascale_plugins as us
from ultrascale_plugins.checkpoints.sharded import save_checkpoint

warnings.filterwarnings("ignore")
logging.getLogger("torch._dynamo").setLevel(logging.ERROR)


def llama(hidden: int, layers: int):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64 + 64,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def batch(rows: int, seq: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 4096, (rows, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def build(layout: dict, args):
    pmodel = us.parallelize(llama(args.hidden, args.layers), us.ParallelConfig(**layout))
    return pmodel, pmodel.build_optimizer(torch.optim.AdamW, lr=1e-4)


def step(pmodel, opt, i: int, args) -> float:
    start = time.perf_counter()
    loss = pmodel.train_step(batch(args.rows, args.seq, i))
    pmodel.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    dist.barrier()
    return time.perf_counter() - start, loss.item()


def alternate(layouts: dict, args) -> dict:
    """Build every layout, time its first step (compilation included), then alternate their steps."""
    runs = {name: build(layout, args) for name, layout in layouts.items()}
    first, times, losses = {}, {name: [] for name in runs}, {name: [] for name in runs}
    for name, (pmodel, opt) in runs.items():
        first[name], loss = step(pmodel, opt, 0, args)
        losses[name].append(loss)
    for i in range(1, args.steps + 1):
        for name, (pmodel, opt) in runs.items():
            t, loss = step(pmodel, opt, i, args)
            times[name].append(t)
            losses[name].append(loss)
    out = {name: {"first_step_s": first[name], "median_step_s": statistics.median(times[name]),
                  "max_loss_diff_vs_first": max(abs(a - b) for a, b in zip(losses[name], losses[next(iter(runs))]))}
           for name in runs}
    return out


def compile_section(args) -> dict:
    base = {"dp_shard": dist.get_world_size(), "activation_checkpointing": "selective"}
    r = alternate({"eager": base, "regional": {**base, "compile": "regional"}}, args)
    r["ratio_regional_over_eager"] = r["regional"]["median_step_s"] / r["eager"]["median_step_s"]
    r["compile_s"] = r["regional"]["first_step_s"] - r["regional"]["median_step_s"]
    return r


def prefetch_section(args) -> dict:
    base = {"dp_shard": dist.get_world_size()}
    r = alternate({"default": base, "prefetch_2": {**base, "fsdp_forward_prefetch": 2, "fsdp_backward_prefetch": 2}},
                  args)
    r["ratio_prefetch_over_default"] = r["prefetch_2"]["median_step_s"] / r["default"]["median_step_s"]
    return r


def async_save_section(args) -> dict:
    """Wall time of the save plus the ``--steps`` steps after it, blocking vs asynchronous (committed at the end),
    alternating, ``--repeats`` times each; and the same steps without a save."""
    pmodel, opt = build({"dp_shard": dist.get_world_size()}, args)
    step(pmodel, opt, 0, args)
    root = Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None
    holder = [str(root)]
    dist.broadcast_object_list(holder)
    root = Path(holder[0])
    walls = {"no_save": [], "blocking": [], "async": []}
    call = {"blocking": [], "async": []}
    for r in range(args.repeats):
        for mode in walls:
            start = time.perf_counter()
            pending = None
            if mode != "no_save":
                pending = save_checkpoint(pmodel, opt, root / mode, step=r, asynchronous=(mode == "async"))
                call[mode].append(time.perf_counter() - start)
            for i in range(args.steps):
                step(pmodel, opt, i, args)
                if mode == "async":
                    pending.poll()
            if mode == "async":
                pending.wait()
            dist.barrier()
            walls[mode].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    size = sum(p.numel() * p.element_size() for p in pmodel.parameters())
    med = {k: statistics.median(v) for k, v in walls.items()}
    return {"steps_after_save": args.steps, "repeats": args.repeats, "param_bytes_per_rank": size,
            "median_wall_s": med, "median_save_call_s": {k: statistics.median(v) for k, v in call.items()},
            "save_overhead_s": {k: med[k] - med["no_save"] for k in ("blocking", "async")},
            "ratio_async_over_blocking_wall": med["async"] / med["blocking"]}


SECTIONS = {"compile": compile_section, "prefetch": prefetch_section, "async_save": async_save_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4, help="rows per data-parallel rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    us.init_distributed(timeout=600)
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, "
              f"{torch.get_num_threads()} thread/rank, {dist.get_world_size()} CPU ranks (gloo)",
              "torch": torch.__version__, "command": "python -m torch.distributed.run --standalone --nproc_per_node "
              f"{dist.get_world_size()} benchmarks/fast_paths_cpu.py", "args": vars(args)}
    for name in args.sections.split(","):
        result[name] = SECTIONS[name](args)
        if dist.get_rank() == 0:
            print(name, json.dumps(result[name], indent=1), flush=True)
    if dist.get_rank() == 0 and args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

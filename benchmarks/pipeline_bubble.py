"""Measured pipeline idle fraction per schedule, next to the theoretical bubble, in one run.

Each rank times its compute (forward, input-gradient and weight-gradient chunks) during a training step; the
rest of the step is idle (bubble plus waiting on point-to-point transfers). Reported: the median over steps of
the mean over ranks. The theoretical idle fraction of a schedule with bubble ratio B = bubble / compute is
B / (1 + B): GPipe and 1F1B B = (p-1)/m, interleaved 1F1B (p-1)/(v*m), zero bubble (ZB-H1) about (p-1)/(3m),
ZBV and DualPipeV about 0 (formulas: shared reference notes, Ultra-Scale Playbook / ZB-pipeline papers).

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/pipeline_bubble.py --microbatches 4
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import ultrascale_plugins as us

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2), ("dualpipev", 2)]


def theory(schedule: str, p: int, v: int, m: int) -> tuple[str, float]:
    if schedule in ("gpipe", "1f1b"):
        return "(p-1)/m", (p - 1) / m
    if schedule == "interleaved_1f1b":
        return "(p-1)/(v*m)", (p - 1) / (v * m)
    if schedule == "zero_bubble":
        return "(p-1)/(3*m)", (p - 1) / (3 * m)
    return "~0", 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rows-per-microbatch", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    us.init_distributed(timeout=600)
    p, m = dist.get_world_size(), args.microbatches
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=args.seq_len)
    batch = {"input_ids": torch.randint(0, 256, (m * args.rows_per_microbatch, args.seq_len),
                                        generator=torch.Generator().manual_seed(0))}
    rows = []
    for schedule, v in SCHEDULES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        layout = us.ParallelConfig(pp=p, pp_schedule=schedule, pp_virtual_stages=v, pp_microbatches=m)
        pmodel = us.parallelize(model, layout)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
        idle, steps = [], []
        for step in range(args.steps + 1):  # the first step builds the schedule: not measured
            pmodel.train_step(batch)
            opt.step()
            opt.zero_grad()
            stats = pmodel.pipeline_stats
            fractions = [None] * p
            dist.all_gather_object(fractions, stats["idle_fraction"])
            if step > 0:
                idle.append(sum(fractions) / p)
                steps.append(stats["step_s"])
        name, b = theory(schedule, p, v if schedule not in ("zbv", "dualpipev") else 2, m)
        rows.append({"schedule": schedule, "p": p, "v": v, "m": m, "theory": name,
                     "theory_idle_fraction": round(b / (1 + b), 3),
                     "measured_idle_fraction": round(statistics.median(idle), 3),
                     "median_step_s": round(statistics.median(steps), 3)})
    if dist.get_rank() == 0:
        print(f"{'schedule':<18}{'p':>3}{'v':>3}{'m':>4}  {'theory':<12}{'theory idle':>12}{'measured idle':>15}"
              f"{'step s':>9}")
        for r in rows:
            print(f"{r['schedule']:<18}{r['p']:>3}{r['v']:>3}{r['m']:>4}  {r['theory']:<12}"
                  f"{r['theory_idle_fraction']:>12.3f}{r['measured_idle_fraction']:>15.3f}{r['median_step_s']:>9.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
                           f"{torch.get_num_threads()} threads/rank, torch {torch.__version__}", "rows": rows}, f,
                          indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

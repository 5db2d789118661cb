"""LoRA against full fine-tuning of the same ~0.5B Llama, built on the meta device, under ZeRO-3 on 4 CPU ranks:
peak host memory per rank and step time, each run in its own launch (peak RSS is a process's lifetime high), the
two launches back to back in one invocation; times are medians of the steps after the first.

    python benchmarks/peft_memory_cpu.py --out benchmarks/results/peft_memory_cpu.json
    python benchmarks/peft_memory_cpu.py --size tiny      # a quick check of the script itself

Each rank also reports the gradient and optimizer bytes it holds and the estimate's figures for them
(``us.estimate``, the numbers ``ultrascale plan`` and ``layout: auto`` use).
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
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {  # ~0.5B: hidden 1024, 24 layers, MLP 4096, vocabulary 49152, untied head (478 M parameters)
    "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=49152),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(mode: str, size: str, seq: int, steps: int, rank_r: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ultrascale_plugins as us

    sys.path.insert(0, str(HERE.parent / "tests"))
    from parity_worker import holdings

    warnings.filterwarnings("ignore")
    us.init_distributed(timeout=600)
    baseline = rss_mb()
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=seq, tie_word_embeddings=False)

    def build():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            if mode == "lora":
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(model, LoraConfig(r=rank_r, lora_alpha=2 * rank_r, lora_dropout=0.0,
                                                         target_modules="all-linear"))
        return model

    model = build()
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layout = us.ParallelConfig(dp_shard=dist.get_world_size())
    pmodel = us.parallelize(model, layout)
    mesh = pmodel.dims.mesh
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    predicted = us.estimate(layout, config, world_size=dist.get_world_size(), seq_len=seq, coords=coords,
                            model=build(), check=False).memory
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-4)  # torch's default: foreach
    times = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
        start = time.perf_counter()
        pmodel.train_step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
        pmodel.clip_grad_norm_(1.0)
        opt.step()
        mark = time.perf_counter()
        if i == steps - 1:
            held = holdings(pmodel, opt)  # gradients and optimizer state exist now (not timed: a small sum)
            start += time.perf_counter() - mark
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    row = {"rank": dist.get_rank(), "peak_rss_mb": round(peak, 1), "baseline_rss_mb": round(baseline, 1),
           "step_s": [round(t, 3) for t in times], "held_bytes": held,
           "predicted_bytes": {k: int(predicted[k]) for k in ("params", "grads", "optimizer") if k in predicted}}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"mode": mode, "params": n_params, "trained": n_trained, "ranks": rows}))
    dist.destroy_process_group()


def launch(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               __file__, "--worker", mode, "--size", args.size, "--seq", str(args.seq), "--steps", str(args.steps),
               "--lora-r", str(args.r), "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lora-r", dest="r", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=("full", "lora"))
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.size, args.seq, args.steps, args.r, args.json)
    runs = {mode: launch(mode, args) for mode in ("full", "lora")}
    summary = {}
    for mode, run in runs.items():
        ranks = run["ranks"]
        summary[mode] = {
            "params": run["params"], "trained": run["trained"],
            "peak_rss_mb_max_rank": max(r["peak_rss_mb"] for r in ranks),
            "peak_above_baseline_mb_max_rank": max(r["peak_rss_mb"] - r["baseline_rss_mb"] for r in ranks),
            "step_s_median": statistics.median(t for r in ranks[:1] for t in r["step_s"][1:]),
            "grads_optimizer_bytes_equal_estimate": all(
                r["held_bytes"][k] == r["predicted_bytes"][k] for r in ranks for k in ("grads", "optimizer")),
        }
    result = {
        "script": "benchmarks/peft_memory_cpu.py", "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU, gloo",
        "command": f"python benchmarks/peft_memory_cpu.py --size {args.size} --ranks {args.ranks} --seq {args.seq} "
                   f"--steps {args.steps} --lora-r {args.r}",
        "summary": summary,
        "lora_vs_full": {"peak_rss": round(summary["lora"]["peak_rss_mb_max_rank"]
                                           / summary["full"]["peak_rss_mb_max_rank"], 3),
                         "peak_above_baseline": round(summary["lora"]["peak_above_baseline_mb_max_rank"]
                                                      / summary["full"]["peak_above_baseline_mb_max_rank"], 3),
                         "step_time": round(summary["lora"]["step_s_median"] / summary["full"]["step_s_median"], 3)},
        "runs": runs,
    }
    print(json.dumps({k: result[k] for k in ("summary", "lora_vs_full")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

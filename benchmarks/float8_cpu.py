"""Step time and loss of ``float8: tensorwise`` (or ``rowwise``) vs bf16 alone, on the CPU, in the same run.

Two copies of one Llama (same seed, same batches, ``mixed_precision: bf16``; one with float8) train in one process;
steps alternate between them (warm-up first) so machine noise hits both alike. Prints and writes the median step
time of each, the ratio float8 / bf16 and the loss difference at every step. On a CPU without float8 matrix
hardware float8 is expected to be slower: ``torch._scaled_mm`` runs there, but its 8-bit matmul is no cheaper than a
bf16 one, and every Linear adds the casts (an amax, a scale and a cast per operand, three matmuls) in eager mode.

    OMP_NUM_THREADS=1 python benchmarks/float8_cpu.py --steps 20 --out benchmarks/results/float8_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import ultrascale_plugins as us


def llama(seed: int, args):
    # every projection's features are multiples of 16, so every decoder-layer Linear converts
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]  # other jobs on the machine slow both models alike (steps alternate)
    us.init_distributed(timeout=600)  # a world of one (FSDP's bf16 policy on one rank: the ZeRO-3 code path)

    models = {name: us.parallelize(llama(0, args), us.ParallelConfig(mixed_precision="bf16", float8=recipe))
              for name, recipe in (("bf16", "none"), ("float8", args.recipe))}
    opts = {name: m.build_optimizer(torch.optim.AdamW, lr=args.lr) for name, m in models.items()}
    n_params = sum(p.numel() for p in llama(0, args).parameters())
    # two batches in turn: the model memorizes them, so the loss falls and the comparison is over a learning curve
    # (random tokens alone leave nothing to learn beyond log(vocab))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 8192, (args.batch, args.seq_len), generator=g) for _ in range(2)]
    times = {name: [] for name in models}
    losses = {name: [] for name in models}
    for step in range(args.warmup + args.steps):
        batch = {"input_ids": batches[step % 2]}
        for name in (("bf16", "float8") if step % 2 == 0 else ("float8", "bf16")):
            t0 = time.perf_counter()
            loss = models[name].train_step(dict(batch))
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(elapsed)
            losses[name].append(float(loss))
    med = {k: statistics.median(v) for k, v in times.items()}
    diffs = [abs(a - b) for a, b in zip(losses["float8"], losses["bf16"])]
    import torchao

    result = {"date": time.strftime("%Y-%m-%d"),
              "machine": f"{cpu_name()}, {os.cpu_count()} cores visible, {torch.get_num_threads()} thread(s), "
                         f"1 process, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after",
              "versions": {"torch": torch.__version__, "torchao": torchao.__version__,
                           "python": platform.python_version()},
              "command": "OMP_NUM_THREADS=%d python %s" % (torch.get_num_threads(), " ".join(sys.argv)),
              "recipe": args.recipe, "lr": args.lr, "params_millions": round(n_params / 1e6, 1),
              "model": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                        "vocab": 8192},
              "seq_len": args.seq_len, "batch": args.batch, "steps_timed": args.steps, "warmup": args.warmup,
              "median_step_s": med, "ratio_float8_over_bf16": med["float8"] / med["bf16"],
              "losses": losses, "max_abs_loss_diff": max(diffs), "final_loss_diff": losses["float8"][-1] -
              losses["bf16"][-1]}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

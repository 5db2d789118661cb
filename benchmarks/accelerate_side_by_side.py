"""Accelerate step time: ``UltraScaleAccelerator`` vs Accelerate's own implementation of the same layout, same
model, same data, same loop.

``--layout zero3``: ours (ZeRO-3) vs Accelerate's FSDP2 (``fsdp_version=2``, one ``fully_shard`` unit per decoder
layer). Accelerate runs FSDP only on accelerators: on CPU it silently prepares a DDP model instead
(``DistributedType.MULTI_CPU``), so this pair needs GPUs; the script refuses to report a ratio when Accelerate did
not run FSDP. ``--layout ddp``: ours (``dp_replicate=N``, DDP) vs Accelerate's DDP — runs anywhere.

Each side runs in its own launch (Accelerate's state is process-wide); the driver alternates them
(ours, accelerate, ours, accelerate, ...) so machine noise hits both alike, drops each launch's first 2 steps and
prints the median step time of each and the ratio ours / Accelerate.

    python benchmarks/accelerate_side_by_side.py --layout ddp --nproc 4 --steps 10 --rounds 2
    python benchmarks/accelerate_side_by_side.py --layout zero3 --nproc 8 ...      (GPUs)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

VOCAB, SEQ = 8192, 128


def worker(impl: str, layout: str, steps: int, batch: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, LlamaConfig

    warnings.filterwarnings("ignore")
    if impl == "ours":
        from ultrascale_plugins.integrations.accelerate import UltraScaleAccelerator, UltraScalePlugin

        fields = {"zero_stage": 3} if layout == "zero3" else {"dp_replicate": int(os.environ["WORLD_SIZE"]),
                                                              "dp_shard": 1}
        accelerator = UltraScaleAccelerator(ultrascale_plugin=UltraScalePlugin(**fields))
    elif layout == "ddp":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=not torch.cuda.is_available())
    else:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                                auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
        accelerator = Accelerator(cpu=not torch.cuda.is_available(), fsdp_plugin=plugin)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (steps * batch * accelerator.num_processes, SEQ), generator=g)
    loader = DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=batch)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    times, losses = [], []
    for batch_data in loader:
        dist.barrier()
        start = time.perf_counter()
        loss = model(**batch_data).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"times": times[2:], "losses": losses, "distributed_type": str(accelerator.distributed_type)},
                      f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["ddp", "zero3"], default="ddp")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="rows per process")
    ap.add_argument("--out")
    ap.add_argument("--worker", nargs=2, metavar=("IMPL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.layout, args.steps, args.batch, args.worker[1])
    times = {"ours": [], "accelerate": []}
    kinds = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for impl in ("ours", "accelerate"):
                out = os.path.join(tmp, f"{impl}{r}.json")
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                str(args.nproc), __file__, "--layout", args.layout, "--steps", str(args.steps),
                                "--batch", str(args.batch), "--worker", impl, out], env=env, check=True,
                               capture_output=True)
                data = json.load(open(out))
                times[impl] += data["times"]
                kinds[impl] = data["distributed_type"]
    if args.layout == "zero3" and "FSDP" not in kinds["accelerate"]:
        sys.exit(f"Accelerate ran {kinds['accelerate']}, not FSDP (it runs FSDP only on accelerators): no "
                 "like-for-like ratio. Use --layout ddp here, or GPUs")
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["accelerate"])
    import accelerate
    import torch

    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
              f"{args.nproc} CPU ranks (gloo), torch {torch.__version__}, accelerate {accelerate.__version__}",
              "model": "Llama 6 layers, hidden 512, vocab 8192, seq 128", "layout": f"{args.layout} x{args.nproc}",
              "ours_median_s": round(ours, 4), "accelerate_median_s": round(theirs, 4),
              "ratio_ours_over_accelerate": round(ours / theirs, 3), "steps_each": len(times["ours"]),
              "distributed_types": kinds}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

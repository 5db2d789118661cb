"""Loading pretrained HF weights into a sharded layout: ``ultrascale_plugins.from_pretrained`` (meta
init, each rank reads only its shards) vs the usual path (``AutoModelForCausalLM.from_pretrained`` on every rank,
then ``parallelize``), same directory, same run.

A ~134M-parameter Llama saved with ``save_pretrained`` (safetensors, fp32) is loaded under ZeRO-3 over N CPU
ranks. Peak host memory is the largest rise in resident memory of any rank while loading (sampled every 5 ms,
see checkpoint_io.py), which includes the rank's share of the model that stays resident afterwards; with ``--anon``, the
rise of anonymous (heap) memory instead (RSS also counts the safetensors file pages mapped in while reading, which
the kernel can drop). Each method
runs in its own launch (a process's allocator keeps freed memory, which would hide the second method's peak):

    python benchmarks/pretrained_load.py --save /tmp/bench-134m
    for m in ours hf; do for a in "" --anon; do python -m torch.distributed.run --standalone --nproc_per_node 4 \
        benchmarks/pretrained_load.py --dir /tmp/bench-134m --method $m $a; done; done
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_io import timed  # noqa: E402

import ultrascale_plugins as us  # noqa: E402
from ultrascale_plugins.checkpoints.load import from_pretrained  # noqa: E402

warnings.filterwarnings("ignore")


def save(path: str, dtype: str) -> None:
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)
    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size="200MB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", help="write the 134M model's HF directory here and exit (one process)")
    ap.add_argument("--dtype", default="float32", help="dtype of the saved weights (training runs in fp32)")
    ap.add_argument("--dir", default="/tmp/bench-134m")
    ap.add_argument("--method", choices=["ours", "hf"])
    ap.add_argument("--anon", action="store_true", help="measure anonymous (heap) memory instead of RSS")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.save:
        return save(args.save, args.dtype)
    us.init_distributed(timeout=1800)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = us.ParallelConfig(dp_shard=world)
    kept = {}

    def load():
        if args.method == "ours":
            kept["m"] = from_pretrained(args.dir, layout)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32)
            kept["m"] = us.parallelize(model, layout)

    seconds, peak_mb = timed(load, anon=args.anon)
    n_params = sum(p.numel() for p in kept["m"].parameters())
    if rank == 0:
        result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                  f"{world} CPU ranks, torch {torch.__version__}", "params_millions": round(n_params / 1e6, 1),
                  "method": args.method, "seconds": round(seconds, 2),
                  "measure": "heap (RssAnon)" if args.anon else "RSS", "peak_mb_max_rank": round(peak_mb)}
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

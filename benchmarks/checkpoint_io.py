"""Sharded checkpoint save/load vs torch.save / torch.load of a full state dict, same model, same run.

Model and Adam state of a ~134M-parameter Llama under ZeRO-3 on N CPU ranks. "Sharded" is
ultrascale_plugins.checkpoints.sharded (every rank writes its shards in parallel); "full" gathers the full model and
optimizer state to rank 0 and writes one torch.save file, the common single-writer approach. Peak host memory is
the largest rise in resident memory of any rank during the operation (sampled every 5 ms).

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/checkpoint_io.py --dir /tmp/ckpt-bench
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import threading
import time
import warnings

import psutil
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from transformers import AutoModelForCausalLM, LlamaConfig

import ultrascale_plugins as us
from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint

warnings.filterwarnings("ignore")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def anon_rss() -> int:
    """Resident anonymous memory (heap: tensors, buffers), without file pages mapped from disk (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return psutil.Process().memory_info().rss


class PeakRSS:
    """Peak rise of resident memory while the block runs; ``anon=True`` counts heap only (a file read through
    mmap, as safetensors does, shows up in RSS as page cache that the kernel can drop)."""

    def __init__(self, anon: bool = False):
        self.measure = anon_rss if anon else (lambda: psutil.Process().memory_info().rss)

    def __enter__(self):
        self.base, self.peak, self.stop = self.measure(), 0, False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, self.measure() - self.base)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()


def timed(fn, anon: bool = False) -> tuple[float, float]:
    dist.barrier()
    with PeakRSS(anon) as mem:
        start = time.perf_counter()
        fn()
        dist.barrier()
        elapsed = time.perf_counter() - start
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mem.peak)
    return elapsed, max(peaks) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ultrascale-ckpt-bench")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    us.init_distributed(timeout=1800)
    rank = dist.get_rank()
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    pmodel = us.parallelize(model, us.ParallelConfig(dp_shard=dist.get_world_size()))
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-4)
    pmodel.train_step({"input_ids": torch.randint(0, 32000, (1, 32))})
    opt.step()
    opt.zero_grad()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    full_file = os.path.join(args.dir, "full.pt")
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_save():
        state = {"model": get_model_state_dict(pmodel.module, options=opts),
                 "optim": get_optimizer_state_dict(pmodel.module, opt, options=opts)}
        if rank == 0:
            torch.save(state, full_file)

    def full_load():
        state = torch.load(full_file, weights_only=True)
        set_model_state_dict(pmodel.module, state["model"], options=StateDictOptions(full_state_dict=True))
        set_optimizer_state_dict(pmodel.module, opt, state["optim"], options=StateDictOptions(full_state_dict=True))

    rows = {"sharded save": [], "sharded load": [], "full save (torch.save)": [], "full load (torch.load)": []}
    for i in range(args.repeats):
        rows["sharded save"].append(timed(lambda: save_checkpoint(pmodel, opt, args.dir, step=i, keep_last_n=1)))
        rows["sharded load"].append(timed(lambda: load_checkpoint(pmodel, opt, directory=args.dir)))
        rows["full save (torch.save)"].append(timed(full_save))
        rows["full load (torch.load)"].append(timed(full_load))
    if rank == 0:
        result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                  f"{dist.get_world_size()} CPU ranks, torch {torch.__version__}", "params_millions":
                  round(n_params / 1e6, 1), "rows": {k: {"median_s": round(statistics.median(t for t, _ in v), 2),
                                                         "peak_rss_mb_max_rank": round(max(m for _, m in v))}
                                                     for k, v in rows.items()}}
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

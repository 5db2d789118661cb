"""Activation memory per rank under context parallel: sequence lengths 1k-8k at cp = 1, 2, 4, ring and Ulysses.

Activation memory is what the forward keeps for the backward: every tensor autograd saves (caught with
``torch.autograd.graph.saved_tensors_hooks``) except the parameters, counted once per storage, at the end of the
forward of one sequence (batch of 1). That is the figure context parallel divides; the parameters (the same on every cp rank)
and transient buffers are left out. The process's RSS high-water mark is reported beside it for context.

    python benchmarks/cp_memory.py --date 2026-12-04 --out benchmarks/results/cp_memory.json

Model: a Llama of hidden 256, 4 layers, 8 heads / 4 KV heads, vocabulary 256 (1.1 M parameters, fp32), built from
a config; cp=1 is the same engine with transformers' SDPA attention. Each cp runs in one torchrun launch (gloo).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQ_LENS = (1024, 2048, 4096, 8192)


def saved_bytes(run, params) -> int:
    """Bytes of the tensors autograd saves while ``run()`` executes (each storage once), parameters left out."""
    import torch

    storages: dict = {}
    weights = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        if t.device.type != "meta" and t.numel() and t.untyped_storage().data_ptr() not in weights:
            try:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
                storages[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(storages.values()), out


def worker(cp: int, method: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import ultrascale_plugins as us

    us.init_distributed(timeout=600)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    pmodel = us.parallelize(LlamaForCausalLM(config), us.ParallelConfig(cp=cp, cp_method=method, dp_shard=1))
    rows = []
    for seq in SEQ_LENS:
        batch = {"input_ids": torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))}
        nbytes, output = saved_bytes(lambda: pmodel.forward(batch), list(pmodel.parameters()))
        output.loss.backward()
        for p in pmodel.parameters():
            p.grad = None
        rows.append({"seq_len": seq, "activation_bytes": nbytes, "loss": float(output.loss),
                     "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        del output
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=3, metavar=("CP", "METHOD", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cp_memory.json"))
    args = ap.parse_args()
    if args.worker:
        cp, method, out = args.worker
        return worker(int(cp), method, out)
    results = []
    base: dict = {}
    for cp, method in ((1, "ring"), (2, "ring"), (4, "ring"), (2, "ulysses"), (4, "ulysses")):
        tmp = ROOT / f".cp_memory_{cp}_{method}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp),
               __file__, "--worker", str(cp), method, str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              cwd=ROOT)
        if proc.returncode:
            sys.exit(f"cp={cp} {method} failed:\n{proc.stderr[-3000:]}")
        per_rank = json.loads(tmp.read_text())
        tmp.unlink()
        for i, seq in enumerate(SEQ_LENS):
            worst = max(rank[i]["activation_bytes"] for rank in per_rank)
            if cp == 1:
                base[seq] = worst
            row = {"cp": cp, "method": method if cp > 1 else "none (SDPA)", "seq_len": seq,
                   "activation_mb_per_rank": round(worst / 2**20, 2),
                   "ratio_to_cp1": round(worst / base[seq], 3), "ideal": round(1 / cp, 3),
                   "rss_peak_mb_per_rank": round(max(rank[i]["rss_peak_mb"] for rank in per_rank), 1),
                   "loss": per_rank[0][i]["loss"]}
            results.append(row)
            print(f"cp={cp} {row['method']:>11} seq={seq:5d}: {row['activation_mb_per_rank']:8.2f} MB/rank "
                  f"({row['ratio_to_cp1']:.3f} of cp=1, ideal {row['ideal']}), loss {row['loss']:.6f}")
    report = {"benchmark": "activation memory per rank under context parallel", "date": args.date,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only, gloo",
              "command": "python benchmarks/cp_memory.py", "script": "benchmarks/cp_memory.py",
              "model": "Llama hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 256, fp32, batch 1",
              "method": "bytes of the tensors autograd saves for backward during one forward (each storage once, "
                        "parameters excluded), largest rank", "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

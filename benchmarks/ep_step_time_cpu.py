"""Step time of an 8-expert MoE on 4 CPU ranks, three ways to place the experts, measured in one run:
expert parallel (``dp_shard: 4, ep: 4``: each rank holds 2 whole experts), experts sharded by tensor parallel
(``tp: 4``: every rank holds a quarter of every expert, attention split by TP too) and FSDP only (``dp_shard: 4``:
every expert gathered whole on every rank in each layer's turn). Every layout trains the same model from the same
weights on the same global batches; the steps alternate between the layouts (one step of each in turn), so machine
noise hits all alike; times are medians of the steps after the first two of each.

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/ep_step_time_cpu.py \
        --out benchmarks/results/ep_step_time_cpu.json
    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/ep_step_time_cpu.py --size tiny

Also reported per layout: the bytes of expert parameters each rank holds (the estimate's figure, exact in the
parity tests) and the first step's loss (the same in all three: one model).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

SIZES = {  # hidden 512, 4 layers, 8 experts of 1024 (top-2), vocabulary 8192: 61.9 M parameters, 50.3 M of them experts
    "base": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8192, num_experts=8,
                 num_experts_per_tok=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=256, num_experts=8,
                 num_experts_per_tok=2),
}
LAYOUTS = {"ep4": {"dp_shard": 4, "ep": 4}, "tp4": {"tp": 4, "sequence_parallel": True}, "fsdp4": {"dp_shard": 4}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=SIZES, default="base")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", help="JSON file for the results (rank 0 writes it)")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    import ultrascale_plugins as us

    warnings.filterwarnings("ignore")
    us.init_distributed(timeout=900)
    config = Qwen3MoeConfig(**SIZES[args.size], max_position_embeddings=args.seq, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": (ids := torch.randint(0, config.vocab_size, (args.global_batch, args.seq), generator=g)),
                "labels": ids.clone()} for _ in range(args.steps)]
    runs = {}
    for name, layout in LAYOUTS.items():
        torch.manual_seed(0)
        pmodel = us.parallelize(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"),
                                us.ParallelConfig(**layout))
        opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-4)
        expert_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                           for n, p in pmodel.named_parameters() if ".experts." in n)
        runs[name] = {"pmodel": pmodel, "opt": opt, "times": [], "losses": [], "expert_bytes": expert_bytes}
    for batch in batches:  # one step of each layout in turn
        for name, run in runs.items():
            pmodel = run["pmodel"]
            per = args.global_batch // pmodel.data_parallel_size
            rows = {k: v[pmodel.data_parallel_rank * per:(pmodel.data_parallel_rank + 1) * per]
                    for k, v in batch.items()}
            dist.barrier()
            start = time.perf_counter()
            loss = pmodel.train_step(rows)
            pmodel.clip_grad_norm_(1.0)
            run["opt"].step()
            run["opt"].zero_grad()
            dist.barrier()
            run["times"].append(time.perf_counter() - start)
            run["losses"].append(float(loss))
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, {n: r["expert_bytes"] for n, r in runs.items()})
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    medians = {n: statistics.median(r["times"][2:]) for n, r in runs.items()}
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, 4 CPU ranks (gloo), "
                   f"torch {torch.__version__}",
        "command": "python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/ep_step_time_cpu.py "
                   + (f"--size {args.size} " if args.size != "base" else "") + f"--steps {args.steps}",
        "model": {"size": args.size, **SIZES[args.size], "seq": args.seq, "global_batch": args.global_batch,
                  "parameters": sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())},
        "layouts": LAYOUTS,
        "median_step_s": medians,
        "ratio_vs_fsdp4": {n: medians[n] / medians["fsdp4"] for n in medians},
        "first_losses": {n: r["losses"][0] for n, r in runs.items()},
        "expert_bytes_per_rank": held,
        "steps": {n: r["times"] for n, r in runs.items()},
    }
    print(json.dumps({k: result[k] for k in ("median_step_s", "ratio_vs_fsdp4", "first_losses")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Step time of ultrascale_plugins vs the same layout written by hand with the same torch APIs.

Both models start from the same weights and see the same batches; steps alternate between the two (warm-up
first) so machine noise hits both alike. Prints the median step time of each and the ratio ours / hand.

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/step_time_vs_hand.py \
        --dp-shard 2 --tp 2 --steps 10
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
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoModelForCausalLM, LlamaConfig

import ultrascale_plugins as us

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def llama(seed: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def hand_tp_plan(model) -> dict:
    """Megatron-style TP for a Llama, the way the PyTorch tutorials write it: q/k/v and gate/up column-wise,
    o/down row-wise, the head column-wise with its output gathered."""
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return plan


def by_hand(model, dp_shard: int, tp: int):
    """ZeRO-3 x TP the way the PyTorch tutorials write it."""
    dims = [(n, d) for n, d in (("dp_shard", dp_shard), ("tp", tp)) if d > 1]
    mesh = init_device_mesh("cpu", tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims))
    if tp > 1:
        parallelize_module(model, mesh["tp"], hand_tp_plan(model))
    dp_mesh = mesh["dp_shard"] if dp_shard > 1 else None
    if dp_mesh is not None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    return model, (dp_mesh.get_group() if dp_mesh is not None else None), (dp_mesh.size() if dp_mesh else 1), \
        (dp_mesh.get_local_rank() if dp_mesh else 0)


def hand_step(model, group, dp, batch):
    ids = batch["input_ids"]
    targets = F.pad(ids, (0, 1), value=-100)[:, 1:]
    count = (targets != -100).sum().double()
    if group is not None:
        dist.all_reduce(count, group=group)
    logits = model(input_ids=ids, use_cache=False).logits
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    (loss_sum * (dp / count)).backward()
    total = loss_sum.detach().double()
    if group is not None:
        dist.all_reduce(total, group=group)
    return (total / count).float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp-shard", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    us.init_distributed(timeout=600)
    rank = dist.get_rank()

    ours = us.parallelize(llama(0), us.ParallelConfig(dp_shard=args.dp_shard, tp=args.tp))
    hand, group, dp, dp_rank = by_hand(llama(0), args.dp_shard, args.tp)
    assert (dp, dp_rank) == (ours.data_parallel_size, ours.data_parallel_rank)
    n_params = sum(p.numel() for p in llama(0).parameters())
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_hand = torch.optim.AdamW(hand.parameters(), lr=1e-4)
    per = args.global_batch // dp
    g = torch.Generator().manual_seed(0)
    times = {"ours": [], "hand": []}
    losses = {"ours": [], "hand": []}
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, 8192, (args.global_batch, args.seq_len), generator=g)
        batch = {"input_ids": ids[dp_rank * per:(dp_rank + 1) * per]}
        order = ("ours", "hand") if step % 2 == 0 else ("hand", "ours")
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "ours":
                loss = ours.train_step(batch)
                opt_ours.step()
                opt_ours.zero_grad(set_to_none=True)
            else:
                loss = hand_step(hand, group, dp, batch)
                opt_hand.step()
                opt_hand.zero_grad(set_to_none=True)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
                losses[name].append(float(loss))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} "
                  f"threads/rank, {dist.get_world_size()} ranks, torch {torch.__version__}",
                  "params_millions": round(n_params / 1e6, 1), "layout": {"dp_shard": args.dp_shard, "tp": args.tp},
                  "seq_len": args.seq_len, "global_batch": args.global_batch, "steps": args.steps,
                  "median_s": med, "ratio_ours_over_hand": med["ours"] / med["hand"],
                  "max_loss_diff": max(abs(a - b) for a, b in zip(losses["ours"], losses["hand"]))}
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

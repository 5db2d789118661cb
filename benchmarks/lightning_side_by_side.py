"""Lightning step time: ``UltraScaleStrategy`` vs Lightning's ``ModelParallelStrategy`` with the same layout
written by hand in ``configure_model`` (the way Lightning's docs show it), same model, same data, same run.

Pairs: ZeRO-3 over every rank (ours ``dp_shard=N`` vs ``fully_shard`` per decoder layer + root), and TP=2 x
ZeRO-3 (ours ``tp=2`` vs ``parallelize_module`` with Colwise/Rowwise styles + ``fully_shard``). Fits run in
rounds (ours, hand, ours, hand, ...) so machine noise hits both alike; the first 2 steps of each fit are
warm-up. Prints the median step time of each and the ratio ours / hand.

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/lightning_side_by_side.py \
        --steps 8 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, LlamaConfig

import lightning.pytorch as L
from lightning.pytorch.strategies import ModelParallelStrategy

from ultrascale_plugins.integrations.lightning import UltraScaleStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")
for name in ("lightning.pytorch", "lightning.fabric", "torch.distributed.tensor._redistribute"):
    logging.getLogger(name).setLevel(logging.ERROR)
VOCAB, SEQ = 8192, 128


def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


class Tokens(Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Timer(L.Callback):
    def __init__(self):
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        dist.barrier()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        dist.barrier()
        self.times.append(time.perf_counter() - self.start)


class Module(L.LightningModule):
    def __init__(self, hand_tp: int | None = None):
        super().__init__()
        self.hand_tp = hand_tp
        self.model = llama()

    def configure_model(self):
        if self.hand_tp is None:
            return  # UltraScaleStrategy parallelizes the HF model itself
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        from step_time_vs_hand import hand_tp_plan

        model, mesh = self.model, self.device_mesh
        if self.hand_tp > 1:
            parallelize_module(model, mesh["tensor_parallel"], hand_tp_plan(model))
        dp = mesh["data_parallel"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp, reshard_after_forward=False)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit(strategy, hand_tp, world: int, steps: int, batch: int) -> list[float]:
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    trainer.fit(Module(hand_tp), DataLoader(Tokens(steps * batch * world), batch_size=batch))
    return timer.times[2:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="rows per data-parallel rank")
    ap.add_argument("--out")
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    pairs = {
        f"ZeRO-3 x{world}": (lambda: UltraScaleStrategy(dp_shard=world), None,
                             lambda: ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), 1),
        f"TP2 x ZeRO-3 x{world // 2}": (lambda: UltraScaleStrategy(tp=2, dp_shard=world // 2), None,
                                        lambda: ModelParallelStrategy(data_parallel_size=world // 2,
                                                                      tensor_parallel_size=2), 2),
    }
    times = {name: {"ours": [], "hand": []} for name in pairs}
    for _ in range(args.rounds):
        for name, (ours, ours_tp, hand, hand_tp) in pairs.items():
            times[name]["ours"] += fit(ours(), ours_tp, world, args.steps, args.batch)
            times[name]["hand"] += fit(hand(), hand_tp, world, args.steps, args.batch)
    if dist.get_rank() == 0:
        rows = {}
        for name, t in times.items():
            ours, hand = statistics.median(t["ours"]), statistics.median(t["hand"])
            rows[name] = {"ours_median_s": round(ours, 4), "hand_median_s": round(hand, 4),
                          "ratio_ours_over_hand": round(ours / hand, 3), "steps_each": len(t["ours"])}
        result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                  f"{world} CPU ranks (gloo), torch {torch.__version__}, lightning {L.__version__}",
                  "model": "Llama 6 layers, hidden 512, vocab 8192, seq 128", "rows": rows}
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

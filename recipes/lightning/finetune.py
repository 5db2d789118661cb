"""Fine-tune a Hugging Face causal LM with Lightning and any ultrascale layout.

    # a tiny Llama on the bundled corpus, tensor parallel over 2 CPU processes (Lightning launches them)
    python recipes/lightning/finetune.py --strategy ultrascale_tp --devices 2

    # pretrained weights, loaded shard by shard into pp=2 x tp=2 x ZeRO-3 over 8 GPUs
    python recipes/lightning/finetune.py --model path/to/hf_dir --devices 8 --accelerator gpu \
        --set pp=2 --set tp=2 --precision bf16-mixed

    # resume
    python recipes/lightning/finetune.py --strategy ultrascale_zero3 --devices 4 --resume runs/ckpt/last.ckpt

    # supervised fine-tuning on your conversations, loss on the assistant's tokens only (the same data path as
    # `ultrascale train`: the model's tokenizer and chat template, packed rows, a tokenized cache per node)
    python recipes/lightning/finetune.py --model path/to/hf_dir --dataset sft.jsonl --format chat --seq-len 2048

``--strategy`` takes a registered name (ultrascale, ultrascale_zero3, ultrascale_zero2, ultrascale_tp,
ultrascale_tp_sp, ultrascale_pp); ``--set FIELD=VALUE`` builds an explicit ``UltraScaleStrategy`` instead. The
LightningModule below is plain Lightning: the strategy is the only ultrascale-specific line.
"""
from __future__ import annotations

import argparse

import torch
import yaml
from torch.utils.data import DataLoader

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import ultrascale_plugins.integrations.lightning as ul  # registers the strategy names
from ultrascale_plugins.data.corpus import TokenWindows, load_tokens, tiny_llama

class FineTune(L.LightningModule):
    def __init__(self, model_dir: str | None, lr: float):
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self):
        if hasattr(self, "model"):
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.hparams.model_dir:  # built empty; the strategy loads each rank's shards of the weights
            config = AutoConfig.from_pretrained(self.hparams.model_dir)
            with self.trainer.init_module(empty_init=True):
                self.model = AutoModelForCausalLM.from_config(config)
        else:
            self.model = tiny_llama()

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="ultrascale", help="a registered ultrascale strategy name")
    ap.add_argument("--set", dest="fields", action="append", default=[], metavar="FIELD=VALUE",
                    help="an explicit layout instead of a name: --set tp=2 --set pp=2")
    ap.add_argument("--model", help="a save_pretrained directory (default: a tiny Llama from a config)")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4, help="per data-parallel replica")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--val-check-interval", type=int, default=10)
    ap.add_argument("--out", default="runs/lightning")
    ap.add_argument("--resume", help="a checkpoint written by this script (a directory ending in .ckpt)")
    ap.add_argument("--dataset", help="a .jsonl/.json/.parquet/.txt file or directory (default: the bundled corpus "
                    "as bytes)")
    ap.add_argument("--format", default="text", choices=["text", "chat"])
    ap.add_argument("--tokenizer", help="a tokenizer directory (default: --model)")
    ap.add_argument("--no-packing", dest="packing", action="store_false", help="one sample per row, padded")
    ap.add_argument("--eval-fraction", type=float, default=0.05)
    args = ap.parse_args(argv)

    if args.fields:
        fields = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.fields)}
        strategy = ul.UltraScaleStrategy(**fields)
    else:
        strategy = args.strategy
    if args.dataset:  # the command line's data path: tokenized on each node's local rank 0, rows memory-mapped
        from ultrascale_plugins.integrations.lightning_data import UltraScaleDataModule

        data = {"dataset": args.dataset, "format": args.format, "seq_len": args.seq_len, "packing": args.packing,
                "eval_fraction": args.eval_fraction}
        loaders = {"datamodule": UltraScaleDataModule(data, args.tokenizer or args.model, batch_size=args.batch_size)}
    else:
        tokens = load_tokens("builtin")
        split = int(len(tokens) * 0.9)
        loaders = {"train_dataloaders": DataLoader(TokenWindows(tokens[:split], args.seq_len),
                                                   batch_size=args.batch_size, shuffle=True),
                   "val_dataloaders": DataLoader(TokenWindows(tokens[split:], args.seq_len),
                                                 batch_size=args.batch_size)}
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                        strategy=strategy, precision=args.precision, max_steps=args.max_steps,
                        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip or None,
                        val_check_interval=args.val_check_interval, limit_val_batches=4,
                        check_val_every_n_epoch=None, log_every_n_steps=1, logger=CSVLogger(args.out, name="logs"),
                        callbacks=[ModelCheckpoint(dirpath=f"{args.out}/ckpt", save_last=True,
                                                   every_n_train_steps=args.val_check_interval)])
    trainer.fit(FineTune(args.model, args.lr), **loaders, ckpt_path=args.resume)


if __name__ == "__main__":
    main()

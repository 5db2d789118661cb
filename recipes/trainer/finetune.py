"""Fine-tune a Hugging Face causal LM with transformers' ``Trainer`` on any ultrascale layout.

    # a tiny Llama on the bundled corpus, ZeRO-3 over 2 CPU processes
    torchrun --nproc_per_node 2 recipes/trainer/finetune.py --set dp_shard=2

    # pipeline x tensor parallel on 4, checkpoints every 10 steps, then resume the newest
    torchrun --nproc_per_node 4 recipes/trainer/finetune.py --set pp=2 --set tp=2 --save-steps 10
    torchrun --nproc_per_node 4 recipes/trainer/finetune.py --set pp=2 --set tp=2 --save-steps 10 --resume

    # the layout from an Accelerate file instead of --set
    ultrascale accelerate-launch recipes/accelerate/tp_zero3.yaml recipes/trainer/finetune.py

    # pretrained weights, each rank reading only its shards; a Hugging Face directory at the end
    torchrun --nproc_per_node 8 recipes/trainer/finetune.py --model path/to/hf_dir --set tp=2 --save-model out/final

``TrainingArguments`` keeps transformers' defaults (its fused AdamW, its linear schedule, its logging) but for what
the flags set; ``UltraScalePlugin`` is the only ultrascale-specific line.
"""
from __future__ import annotations

import argparse

import torch
import yaml

from ultrascale_plugins.data.corpus import TokenWindows, load_tokens, tiny_llama
from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
from ultrascale_plugins.integrations.trainer import UltraScaleTrainer


def build_model(path: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    if path:  # on the meta device: each rank loads only its shards from the directory (init_from)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return tiny_llama()


def main(argv=None):
    from transformers import TrainingArguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", dest="fields", action="append", default=[], metavar="FIELD=VALUE",
                    help="a layout field (dp_shard=2, tp=2, pp=2, ...); none: the layout of the launch")
    ap.add_argument("--model", help="a save_pretrained directory (default: a tiny Llama from a config)")
    ap.add_argument("--output-dir", default="runs/trainer")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4, help="rows per data-parallel replica per micro-batch")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    ap.add_argument("--save-model", help="write a Hugging Face directory here at the end")
    args = ap.parse_args(argv)

    fields = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.fields)}
    plugin = UltraScalePlugin(init_from=args.model, **fields) if fields else UltraScalePlugin(init_from=args.model)
    training = TrainingArguments(args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                                 gradient_accumulation_steps=args.accumulate, learning_rate=args.lr, logging_steps=5,
                                 save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                                 report_to="none")
    trainer = UltraScaleTrainer(model=build_model(args.model), args=training,
                                train_dataset=TokenWindows(load_tokens(), args.seq_len), ultrascale_plugin=plugin)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.save_model:
        trainer.save_model(args.save_model)  # every rank: the shards are streamed into the directory


if __name__ == "__main__":
    main()

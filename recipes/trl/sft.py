"""Supervised fine-tuning with TRL's SFTTrainer on an ultrascale layout (``UltraScaleSFTTrainer``, docs/trl.md).

    # a pretrained directory, a layout file and the data: a .jsonl of prompt-completion pairs
    # ({"prompt": ..., "completion": ...}: the loss on the completions) or conversations ({"messages": [...]})
    torchrun --nproc_per_node 8 recipes/trl/sft.py --model /models/Llama-3.1-8B-Instruct \\
        --layout recipes/trl/llama-3.1-8b-8gpu.yaml --data data/sft.jsonl --output-dir runs/sft

    # before launching: the layout and its memory at full size, on the model's config.json (no weights, no GPU)
    python recipes/trl/sft.py --check --model recipes/sft/configs/llama-3.1-8b.json \\
        --layout recipes/trl/llama-3.1-8b-8gpu.yaml --nproc 8 --gpu h100-sxm-80gb

Each rank builds the model on the meta device and reads only its shards of ``--model``'s weights. ``SFTConfig``
keeps TRL's defaults but for what the flags set; ``UltraScalePlugin`` and ``UltraScaleSFTTrainer`` are the only
ultrascale-specific lines. ``--set FIELD=VALUE`` overrides a field of the layout file (e.g. ``--set dp_shard=2``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml

from ultrascale_plugins.integrations.accelerate import UltraScalePlugin


def layout_fields(args) -> dict:
    fields = yaml.safe_load(Path(args.layout).read_text()) if args.layout else {}
    fields.update({k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.fields)})
    return fields


def model_config(path: str):
    """The model's config: a save_pretrained directory's config.json, or a config.json file itself."""
    from transformers import AutoConfig

    p = Path(path)
    if p.is_file():
        fields = json.loads(p.read_text())
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    return AutoConfig.from_pretrained(p)


def meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # each rank gives only its shards storage, from --model's files
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if torch.cuda.is_available() else None)


def check(args) -> None:
    """The pre-launch checks at full size (``check_sft_layout``): the layout against the world size and the model
    on the meta device, and the planner's per-rank memory estimate against the GPU preset, with TRL's chunked head."""
    from ultrascale_plugins.integrations.trl import check_sft_layout

    print(check_sft_layout(layout_fields(args), model_config(args.model), args.nproc, args.gpu,
                           max_length=args.max_length, batch_size=args.batch_size, accumulate=args.accumulate))


def arguments(doc: str, *, data: str, output_dir: str, rows: str, max_length: int, lr: float):
    """The flags this script and recipes/trl/dpo.py share (the model, the layout, the data, the loop, --check)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a save_pretrained directory (with --check: or its config.json)")
    ap.add_argument("--layout", help="a layout YAML (ParallelConfig fields); none: the layout of the launch")
    ap.add_argument("--set", dest="fields", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--data", help=data)
    ap.add_argument("--output-dir", default=output_dir)
    ap.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (default: one epoch)")
    ap.add_argument("--batch-size", type=int, default=1, help=f"{rows} per data-parallel replica per micro-batch")
    ap.add_argument("--accumulate", type=int, default=8, help="micro-batches per optimizer step")
    ap.add_argument("--max-length", type=int, default=max_length, help="tokens per row (longer rows are truncated)")
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    ap.add_argument("--check", action="store_true", help="only the pre-launch checks, at full size")
    ap.add_argument("--nproc", type=int, default=8, help="with --check: the processes (GPUs) of the launch")
    ap.add_argument("--gpu", default="h100-sxm-80gb", help="with --check: the GPU preset (ultrascale plan --help)")
    return ap


def main(argv=None):
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig

    from ultrascale_plugins.integrations.trl import UltraScaleSFTTrainer

    ap = arguments(__doc__, data="a .jsonl of prompt-completion pairs or conversations", output_dir="runs/trl-sft",
                   rows="rows", max_length=4096, lr=2e-5)
    args = ap.parse_args(argv)
    if args.check:
        return check(args)

    plugin = UltraScalePlugin(init_from=args.model, **layout_fields(args))
    sft = SFTConfig(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
                    gradient_accumulation_steps=args.accumulate, max_length=args.max_length, learning_rate=args.lr,
                    bf16=torch.cuda.is_available(), save_strategy="steps" if args.save_steps else "no",
                    save_steps=args.save_steps or 500, report_to="none")
    trainer = UltraScaleSFTTrainer(model=meta_model(model_config(args.model)), args=sft,
                                   train_dataset=load_dataset("json", data_files=args.data, split="train"),
                                   processing_class=AutoTokenizer.from_pretrained(args.model),
                                   ultrascale_plugin=plugin)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(args.output_dir + "/final")  # every rank: the shards are streamed into the directory


if __name__ == "__main__":
    main()

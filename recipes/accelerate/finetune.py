"""Fine-tune a Hugging Face causal LM with a standard Accelerate loop and any ultrascale layout.

    # write a config (or use one of the files beside this script), then launch
    ultrascale accelerate-config --num-processes 4 --set pp=2 --set tp=2 --out pp_tp.yaml
    ultrascale accelerate-launch recipes/accelerate/pp_tp.yaml recipes/accelerate/finetune.py --steps 20

    # the same with Accelerate's launcher: the environment variable carries the fields it has no key for
    ULTRASCALE_CONFIG=recipes/accelerate/pp_tp.yaml \
        accelerate launch --config_file recipes/accelerate/pp_tp.yaml recipes/accelerate/finetune.py

    # pretrained weights, each rank reading only its shards; save an HF directory at the end
    ultrascale accelerate-launch recipes/accelerate/tp_zero3.yaml recipes/accelerate/finetune.py \
        --model path/to/hf_dir --save-model out/finetuned

    # supervised fine-tuning on your conversations, loss on the assistant's tokens only (the same data path as
    # `ultrascale train`: the model's tokenizer and chat template, packed rows, a tokenized cache per node)
    ultrascale accelerate-launch recipes/accelerate/zero3.yaml recipes/accelerate/finetune.py \
        --model path/to/hf_dir --dataset sft.jsonl --format chat --seq-len 2048

Only the ``Accelerator`` line is ultrascale-specific; the loop is Accelerate's.
"""
from __future__ import annotations

import argparse
import math

import torch
from torch.utils.data import DataLoader

from ultrascale_plugins.data.corpus import TokenWindows, load_tokens, tiny_llama
from ultrascale_plugins.integrations.accelerate import UltraScaleAccelerator


def build_model(path: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    if path:  # on the meta device: prepare() loads each rank's shards from the directory
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return tiny_llama()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a save_pretrained directory (default: a tiny Llama from a config)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4, help="per data-parallel replica")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--save-state", help="write a sharded checkpoint here at the end")
    ap.add_argument("--resume", help="continue from a save_state directory")
    ap.add_argument("--save-model", help="write a Hugging Face directory here at the end")
    ap.add_argument("--dataset", help="a .jsonl/.json/.parquet/.txt file or directory (default: the bundled corpus "
                    "as bytes)")
    ap.add_argument("--format", default="text", choices=["text", "chat"])
    ap.add_argument("--tokenizer", help="a tokenizer directory (default: --model)")
    ap.add_argument("--no-packing", dest="packing", action="store_false", help="one sample per row, padded")
    args = ap.parse_args(argv)

    accelerator = UltraScaleAccelerator(gradient_accumulation_steps=args.accumulate)
    if args.dataset:  # the command line's data path; each node's first process tokenizes, the others wait
        from ultrascale_plugins.data.data_loaders import build_dataloaders

        data = {"dataset": args.dataset, "format": args.format, "seq_len": args.seq_len, "packing": args.packing}
        with accelerator.local_main_process_first():
            loader, _ = build_dataloaders(data, args.tokenizer or args.model, batch_size=args.batch_size)
    else:
        tokens = load_tokens("builtin")
        loader = DataLoader(TokenWindows(tokens[: int(len(tokens) * 0.9)], args.seq_len),
                            batch_size=args.batch_size, shuffle=True)
    model = build_model(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if args.resume:
        accelerator.load_state(args.resume)
    step = 0
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step += 1
            accelerator.print(f"step {step}: loss {loss.item():.4f}")
            if step == args.steps:
                break
    if args.save_state:
        accelerator.save_state(args.save_state)
    if args.save_model:
        accelerator.save_model(model, args.save_model)
        accelerator.print(f"saved {args.save_model} (AutoModelForCausalLM.from_pretrained loads it)")
    accelerator.end_training()


if __name__ == "__main__":
    main()

"""Preference tuning with TRL's DPOTrainer on an ultrascale layout (``UltraScaleDPOTrainer``, docs/trl.md).

    # a pretrained directory (the SFT model), a layout file and the data: a .jsonl of preference pairs
    # ({"prompt": ..., "chosen": ..., "rejected": ...}, or conversations in TRL's preference format)
    torchrun --nproc_per_node 8 recipes/trl/dpo.py --model runs/sft/final \\
        --layout recipes/trl/llama-3.1-8b-dpo-8gpu.yaml --data data/prefs.jsonl --output-dir runs/dpo

    # before launching: the layout and its memory (policy and reference) at full size, on the config.json
    python recipes/trl/dpo.py --check --model recipes/sft/configs/llama-3.1-8b.json \\
        --layout recipes/trl/llama-3.1-8b-dpo-8gpu.yaml --nproc 8 --gpu h100-sxm-80gb

The reference model is a second copy of ``--model``, built on the meta device and sharded in the same layout: each
rank reads only its shards of both. ``--lora R`` trains LoRA adapters instead (the reference is then the model
with its adapters disabled, no second copy); ``--precompute`` computes the reference's log-probabilities once
before training (TRL's ``precompute_ref_log_probs``: no reference kept). ``DPOConfig`` keeps TRL's defaults (the
sigmoid loss, beta 0.1) but for what the flags set. ``--set FIELD=VALUE`` overrides a field of the layout file.
"""
from __future__ import annotations

import torch

from sft import arguments, layout_fields, meta_model, model_config  # recipes/trl/sft.py: the same files and flags
from ultrascale_plugins.integrations.accelerate import UltraScalePlugin


def check(args) -> None:
    """The pre-launch checks at full size (``check_dpo_layout``): the layout against the world size and the model
    on the meta device, and the planner's per-rank memory estimate of the policy (chosen and rejected rows) and,
    unless LoRA or precomputed, the reference's weights, against the GPU preset."""
    from ultrascale_plugins.integrations.trl import check_dpo_layout

    print(check_dpo_layout(layout_fields(args), model_config(args.model), args.nproc, args.gpu,
                           max_length=args.max_length, batch_size=args.batch_size, accumulate=args.accumulate,
                           reference=not (args.lora or args.precompute)))


def main(argv=None):
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from ultrascale_plugins.integrations.trl import UltraScaleDPOTrainer

    ap = arguments(__doc__, data="a .jsonl of preference pairs", output_dir="runs/trl-dpo", rows="pairs",
                   max_length=2048, lr=5e-7)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--loss-type", default="sigmoid", help="TRL's loss_type (comma-separated to combine)")
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R (0: the model)")
    ap.add_argument("--precompute", action="store_true", help="the reference's log-probabilities once, up front")
    ap.add_argument("--logging-steps", type=int, default=10, help="log the loss and TRL's rewards every N steps")
    args = ap.parse_args(argv)
    if args.check:
        return check(args)

    plugin = UltraScalePlugin(init_from=args.model, **layout_fields(args))
    dpo = DPOConfig(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
                    gradient_accumulation_steps=args.accumulate, max_length=args.max_length, learning_rate=args.lr,
                    beta=args.beta, loss_type=args.loss_type.split(","), precompute_ref_log_probs=args.precompute,
                    bf16=torch.cuda.is_available(), save_strategy="steps" if args.save_steps else "no",
                    save_steps=args.save_steps or 500, logging_steps=args.logging_steps, report_to="none")
    config = model_config(args.model)
    extra = {}
    if args.lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear")
    elif not args.precompute:
        extra["ref_model"] = meta_model(config)  # sharded as the policy, its shards read from --model
    trainer = UltraScaleDPOTrainer(model=meta_model(config), args=dpo,
                                   train_dataset=load_dataset("json", data_files=args.data, split="train"),
                                   processing_class=AutoTokenizer.from_pretrained(args.model),
                                   ultrascale_plugin=plugin, **extra)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(args.output_dir + "/final")  # every rank: the shards are streamed into the directory


if __name__ == "__main__":
    main()

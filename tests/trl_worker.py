"""TRL's SFTTrainer under ultrascale (UltraScaleSFTTrainer) against plain TRL in one process (tests/test_trl.py).

    python trl_worker.py TOKENIZER OUT_DIR reference                      plain SFTTrainer, one process
    torchrun --nproc_per_node N trl_worker.py TOKENIZER OUT_DIR CASE ...  UltraScaleSFTTrainer, each case in turn

The same tiny Llama (the tokenizer's vocabulary), the same prompt-completion rows (TRL's completion-only loss) and
SFTConfig's defaults but for: no bf16 (a CPU), 4 steps of 8 rows read in order (the data-parallel ranks split each
step's rows), a learning rate of 1e-3, and logging every step. Each run writes OUT_DIR/CASE.json (rank 0: the
logged loss, grad_norm, entropy, mean_token_accuracy and num_tokens of every step) and saves the trained model to
OUT_DIR/CASE (trainer.save_model).
"""
from __future__ import annotations

import json
import os
import random
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GLOBAL_BATCH, STEPS = 8, 4
CASES = {
    "zero3": {"dp_shard": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    # a mixture of experts (Qwen3-MoE, 8 experts, top-2) with TRL's router auxiliary loss (its default coefficient
    # from the config: 0.001), experts split over 2 ranks; plain TRL: reference_ep2_moe
    "ep2_moe": {"dp_shard": 2, "ep": 2, "_arch": "qwen3_moe"},
    # DFT's gradients are small: a lower max_grad_norm keeps clipping active at every step
    "zero3_dft": {"dp_shard": 2, "_sft": {"loss_type": "dft", "max_grad_norm": 0.002}},
    "cp2_ring": {"cp": 2},
    "cp2_ulysses": {"cp": 2, "cp_method": "ulysses"},
    # ZeRO-2, and evaluation every 2 steps on held-out rows (eval_loss and TRL's eval metrics)
    "zero2_eval": {"dp_shard": 2, "zero_stage": 2, "_sft": {"eval_strategy": "steps", "eval_steps": 2}},
    # a class of the user's on both (class MySFT(UltraScaleTrainer, SFTTrainer)) instead of UltraScaleSFTTrainer
    "zero1": {"dp_shard": 2, "zero_stage": 1, "_hand": True},
    # TRL's packing: rows packed padding-free (position_ids restart per document, no attention mask)
    "cp2_ring_packed": {"cp": 2, "_sft": {"packing": True, "max_length": 64}},
    # checkpoints: saved every 2 steps under ZeRO-3, resumed from step 2 under TP + SP (another layout); plain TRL
    # does the same in one process (reference_zero3_save, reference_tp2_sp_resume)
    "zero3_save": {"dp_shard": 2, "_sft": {"save_strategy": "steps", "save_steps": 2}},
    "tp2_sp_resume": {"tp": 2, "sequence_parallel": True, "_resume": "zero3_save"},
    # LoRA (TRL's peft_config): only the adapters train; their smaller gradients clip at 0.1
    "zero3_lora": {"dp_shard": 2, "_peft": True, "_sft": {"max_grad_norm": 0.1}},
    "tp2_sp_lora": {"tp": 2, "sequence_parallel": True, "_peft": True, "_sft": {"max_grad_norm": 0.1}},
}
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens", "aux_loss")


def rows(n: int = GLOBAL_BATCH * STEPS, seed: int = 0) -> list[dict]:
    from tiny_tokenizer import WORDS

    r = random.Random(seed)
    words = lambda lo, hi: " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))  # noqa: E731
    return [{"prompt": words(2, 8), "completion": " " + words(2, 12)} for _ in range(n)]


def model_for(tokenizer, arch: str = "llama"):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    else:
        config = LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def run(tokenizer_dir: str, out_dir: str, case: str) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    layout = dict(CASES.get(case, {}))
    sft = layout.pop("_sft", {})
    peft = layout.pop("_peft", False)
    resume = layout.pop("_resume", None)
    arch = layout.pop("_arch", "llama")
    hand = layout.pop("_hand", False)
    logs: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                record.append({k: float(logs[k]) for k in LOGGED if k in logs})
            if logs and "eval_loss" in logs:
                evaluated.append({k: float(logs[f"eval_{k}"]) for k in LOGGED if f"eval_{k}" in logs})

    record, evaluated = logs, []
    if case == "reference" or case.startswith("reference_"):
        cls, extra, dp = SFTTrainer, {}, 1
        mirrored = CASES.get(case.removeprefix("reference_"), {})
        sft, peft, resume = dict(mirrored.get("_sft", {})), mirrored.get("_peft", False), mirrored.get("_resume")
        resume = f"reference_{resume}" if resume else None
        arch = mirrored.get("_arch", "llama")
    else:
        from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
        from ultrascale_plugins.integrations.trl import UltraScaleSFTTrainer
        from ultrascale_plugins.interface.config import ParallelConfig

        dp = ParallelConfig(**layout).resolve(int(os.environ["WORLD_SIZE"])).dp
        cls, extra = UltraScaleSFTTrainer, {"ultrascale_plugin": UltraScalePlugin(**layout)}
        if hand:
            from ultrascale_plugins.integrations.trainer import UltraScaleTrainer

            cls = type("MySFT", (UltraScaleTrainer, SFTTrainer), {})
    args = SFTConfig(output_dir=os.path.join(out_dir, f"run-{case}"), per_device_train_batch_size=GLOBAL_BATCH // dp,
                     max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[], bf16=False, seed=0,
                     disable_tqdm=True, train_sampling_strategy="sequential", **({"save_strategy": "no"} | sft))
    if peft:  # TRL wraps the model with LoRA itself (peft_config), its adapters drawn from the seed
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    torch.manual_seed(1)
    if args.eval_strategy != "no":  # held-out rows, split over the data-parallel ranks like the training rows
        extra["eval_dataset"] = Dataset.from_list(rows(2 * GLOBAL_BATCH, seed=1))
        args.per_device_eval_batch_size = GLOBAL_BATCH // dp
    trainer = cls(model=model_for(tokenizer, arch), args=args, train_dataset=Dataset.from_list(rows()),
                  processing_class=tokenizer, callbacks=[Record()], **extra)
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"run-{resume}", "checkpoint-2") if resume else None)
    trainer.save_model(os.path.join(out_dir, case))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out_dir, f"{case}.json"), "w") as f:
            json.dump({"logs": logs, "eval": evaluated}, f)


def main() -> None:
    tokenizer_dir, out_dir, *cases = sys.argv[1:]
    for case in cases:
        run(tokenizer_dir, out_dir, case)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


if __name__ == "__main__":
    main()

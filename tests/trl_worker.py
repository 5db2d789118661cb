"""TRL's SFTTrainer and DPOTrainer under ultrascale (UltraScaleSFTTrainer, UltraScaleDPOTrainer) against plain TRL
in one process (tests/test_trl.py).

    python trl_worker.py TOKENIZER OUT_DIR reference reference_CASE ...   plain TRL, one process
    torchrun --nproc_per_node N trl_worker.py TOKENIZER OUT_DIR CASE ...  ultrascale, each case in turn

The same tiny Llama (the tokenizer's vocabulary), the same rows (SFT: prompt-completion, TRL's completion-only
loss; DPO, cases named dpo_*: prompt, chosen and rejected) and SFTConfig's / DPOConfig's defaults but for: no bf16
(a CPU), 4 steps of 8 rows read in order (the data-parallel ranks split each step's rows), a learning rate of 1e-3,
logging every step, and for DPO a max_grad_norm of 0.5 (its gradients are small: clipping stays active). Each run
writes OUT_DIR/CASE.json (rank 0: what TRL logs at every step, and DPO's reference model as this rank holds it) and
saves the trained model to OUT_DIR/CASE (trainer.save_model).
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
    # conversations of two turns under TRL's chat template (one with generation tags): the loss on the assistant's
    # replies only (assistant_only_loss)
    "cp2_ring_assistant": {"cp": 2, "_sft": {"assistant_only_loss": True}, "_messages": True},
    # 4 processes (tests/test_trl.py::test_four_process_layouts_match_plain_trl): HSDP, 2 replicas of 2 ZeRO-3 shards
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
    # pipelines: TRL's loss on the last stage, inside the schedule (2 decoder layers: one a stage; 4 for the
    # schedules with 2 stages a rank)
    "pp2_1f1b": {"pp": 2, "pp_schedule": "1f1b"},
    "pp2_gpipe_dft": {"pp": 2, "pp_schedule": "gpipe", "_sft": {"loss_type": "dft", "max_grad_norm": 0.002}},
    "pp2_interleaved": {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "_layers": 4},
    "pp2_zbv_eval": {"pp": 2, "pp_schedule": "zbv", "_layers": 4,
                     "_sft": {"eval_strategy": "steps", "eval_steps": 2}},
    "pp2_zero_bubble": {"pp": 2, "pp_schedule": "zero_bubble", "pp_virtual_stages": 2, "_layers": 4},
    "pp2_dualpipev": {"pp": 2, "pp_schedule": "dualpipev", "_layers": 4},
    "pp2_lora": {"pp": 2, "_peft": True, "_sft": {"max_grad_norm": 0.1}},
    # gradient accumulation: 2 micro-batches of 2 rows a rank per step (TRL weighs them by their tokens)
    "zero3_ga2": {"dp_shard": 2, "_sft": {"gradient_accumulation_steps": 2}},
    # 4 processes (test_trl.py::test_four_process_layouts_match_plain_trl): compositions
    "dp2_tp2_sp": {"dp_shard": 2, "tp": 2, "sequence_parallel": True},
    "pp2_tp2": {"pp": 2, "tp": 2},
    "pp2_dp2": {"pp": 2, "dp_shard": 2},
}
# DPOTrainer (UltraScaleDPOTrainer; cases named dpo_*), its default sigmoid loss unless named. Where the reference
# comes from: "_ref": "path" (the model given by name: TRL loads the policy and a second copy, the reference, which
# the accelerator shards), "copy" (ref_model= a second model), "precompute" (precompute_ref_log_probs: the policy
# before training, no reference kept), or none with LoRA (the policy with its adapters disabled)
DPO_CASES = {
    "dpo": {"_ref": "copy"},  # plain TRL (reference_dpo), the default loss: the layouts below that keep it
    "dpo_zero3": {"dp_shard": 2, "_ref": "path"},
    "dpo_tp2_sp": {"tp": 2, "sequence_parallel": True, "_ref": "copy"},
    "dpo_cp2_ulysses": {"cp": 2, "cp_method": "ulysses", "_ref": "precompute"},
    "dpo_zero2_ipo_eval": {"dp_shard": 2, "zero_stage": 2, "_ref": "copy",
                           "_sft": {"loss_type": ["ipo"], "eval_strategy": "steps", "eval_steps": 2}},
    "dpo_cp2_ring_hinge": {"cp": 2, "_ref": "copy", "_sft": {"loss_type": ["hinge"]}},
    "dpo_ep2_moe": {"dp_shard": 2, "ep": 2, "_arch": "qwen3_moe", "_ref": "copy"},
    "dpo_zero3_lora": {"dp_shard": 2, "_peft": True, "_sft": {"max_grad_norm": 0.1}},
    "dpo_ddp": {"dp_replicate": 2, "_ref": "copy"},
    "dpo_hsdp": {"dp_replicate": 2, "dp_shard": 2, "_ref": "path"},  # 4 processes
    # pipelines: each micro-batch holds whole pairs; the reference model a pipeline of its own, or precomputed
    "dpo_pp2_1f1b": {"pp": 2, "pp_schedule": "1f1b", "_ref": "copy"},
    "dpo_pp2_dp2": {"pp": 2, "dp_shard": 2, "_ref": "copy"},  # 4 processes
    "dpo_pp2_zbv_eval": {"pp": 2, "pp_schedule": "zbv", "_layers": 4, "_ref": "precompute",
                         "_sft": {"eval_strategy": "steps", "eval_steps": 2}},
    # gradient accumulation: 2 micro-batches of 2 pairs a step (TRL weighs them evenly)
    "dpo_tp2_sp_ga2": {"tp": 2, "sequence_parallel": True, "_ref": "copy", "_sft": {"gradient_accumulation_steps": 2}},
    "dpo_tp2_sp_lora": {"tp": 2, "sequence_parallel": True, "_peft": True, "_sft": {"max_grad_norm": 0.1}},
    # checkpoints: saved every 2 steps under ZeRO-3, resumed from step 2 under TP + SP (the reference model is not
    # in the checkpoint: the resumed trainer is given it again, as a plain TRL run resuming is)
    "dpo_zero3_save": {"dp_shard": 2, "_ref": "copy", "_sft": {"save_strategy": "steps", "save_steps": 2}},
    "dpo_tp2_sp_resume": {"tp": 2, "sequence_parallel": True, "_ref": "copy", "_resume": "dpo_zero3_save"},
    # a pad token added to the tokenizer without resizing the model: its id lies outside the embedding, and TRL
    # copies it into model.config (the checks' meta twins were built from that config and failed); rows of one
    # length, so no pad is embedded and plain TRL trains (issue 47)
    "dpo_zero3_pad_outside": {"dp_shard": 2, "_ref": "copy", "_pad_outside": True},
}
CASES.update(DPO_CASES)
DPO_LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens", "aux_loss", "rewards/chosen",
              "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
              "logits/chosen", "logits/rejected")
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens", "aux_loss")


def rows(n: int = GLOBAL_BATCH * STEPS, seed: int = 0) -> list[dict]:
    from tiny_tokenizer import WORDS

    r = random.Random(seed)
    words = lambda lo, hi: " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))  # noqa: E731
    return [{"prompt": words(2, 8), "completion": " " + words(2, 12)} for _ in range(n)]


def model_for(tokenizer, arch: str = "llama", layers: int = 2):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    else:
        config = LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def conversations(n: int = GLOBAL_BATCH * STEPS, seed: int = 0) -> list[dict]:
    """Two-turn conversations (user, assistant, user, assistant)."""
    turns = rows(2 * n, seed)
    return [{"messages": [m for t in turns[2 * i:2 * i + 2] for m in (
        {"role": "user", "content": t["prompt"]}, {"role": "assistant", "content": t["completion"].strip()})]}
        for i in range(n)]


def pairs(n: int = GLOBAL_BATCH * STEPS, seed: int = 0) -> list[dict]:
    """Preference rows: a prompt, a chosen and a rejected completion."""
    from tiny_tokenizer import WORDS

    r = random.Random(seed)
    words = lambda lo, hi: " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))  # noqa: E731
    return [{"prompt": words(2, 8), "chosen": " " + words(2, 10), "rejected": " " + words(2, 10)} for _ in range(n)]


def even_pairs(n: int = GLOBAL_BATCH * STEPS, seed: int = 0) -> list[dict]:
    """Preference rows of one length in tokens (words the tiny tokenizer holds as one token each): a batch of
    them needs no padding."""
    r = random.Random(seed)
    one = "the quick brown fox jumps over a lazy dog while seven wizards box".split()
    words = lambda k: " ".join(r.choice(one) for _ in range(k))  # noqa: E731
    return [{"prompt": words(5), "chosen": " " + words(6), "rejected": " " + words(6)} for _ in range(n)]


def run(tokenizer_dir: str, out_dir: str, case: str) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    layout = dict(CASES.get(case, {}))
    sft = layout.pop("_sft", {})
    peft = layout.pop("_peft", False)
    resume = layout.pop("_resume", None)
    arch = layout.pop("_arch", "llama")
    hand = layout.pop("_hand", False)
    ref = layout.pop("_ref", None)
    messages = layout.pop("_messages", False)
    layers = layout.pop("_layers", 2)
    pad_outside = layout.pop("_pad_outside", False)
    logs: list[dict] = []
    dpo = case.removeprefix("reference_").startswith("dpo")
    logged = DPO_LOGGED if dpo else LOGGED

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                record.append({k: float(logs[k]) for k in logged if k in logs})
            if logs and "eval_loss" in logs:
                evaluated.append({k: float(logs[f"eval_{k}"]) for k in logged if f"eval_{k}" in logs})

    record, evaluated = logs, []
    if case == "reference" or case.startswith("reference_"):
        cls, extra, dp = (DPOTrainer if dpo else SFTTrainer), {}, 1
        mirrored = CASES.get(case.removeprefix("reference_"), {})
        sft, peft, resume = dict(mirrored.get("_sft", {})), mirrored.get("_peft", False), mirrored.get("_resume")
        resume = f"reference_{resume}" if resume else None
        arch, ref, messages = mirrored.get("_arch", "llama"), mirrored.get("_ref"), mirrored.get("_messages", False)
        layers, pad_outside = mirrored.get("_layers", 2), mirrored.get("_pad_outside", False)
    else:
        from ultrascale_plugins.integrations import trl as integration
        from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
        from ultrascale_plugins.interface.config import ParallelConfig

        dp = ParallelConfig(**layout).resolve(int(os.environ["WORLD_SIZE"])).dp
        cls = integration.UltraScaleDPOTrainer if dpo else integration.UltraScaleSFTTrainer
        extra = {"ultrascale_plugin": UltraScalePlugin(**layout)}
        if hand:
            from ultrascale_plugins.integrations.trainer import UltraScaleTrainer

            cls = type("MySFT", (UltraScaleTrainer, SFTTrainer), {})
    config = DPOConfig if dpo else SFTConfig
    if dpo:
        sft = {"max_grad_norm": 0.5, **sft, "precompute_ref_log_probs": ref == "precompute"}
    rows_each = GLOBAL_BATCH // dp // sft.get("gradient_accumulation_steps", 1)  # the same rows a step, any window
    args = config(output_dir=os.path.join(out_dir, f"run-{case}"), per_device_train_batch_size=rows_each,
                  max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[], bf16=False, seed=0,
                  disable_tqdm=True, train_sampling_strategy="sequential", **({"save_strategy": "no"} | sft))
    if peft:  # TRL wraps the model with LoRA itself (peft_config), its adapters drawn from the seed
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    torch.manual_seed(1)
    data = (even_pairs if pad_outside else pairs) if dpo else conversations if messages else rows
    if messages:
        from tiny_tokenizer import CHATML_TAGGED

        tokenizer.chat_template = CHATML_TAGGED
    if args.eval_strategy != "no":  # held-out rows, split over the data-parallel ranks like the training rows
        extra["eval_dataset"] = Dataset.from_list(data(2 * GLOBAL_BATCH, seed=1))
        args.per_device_eval_batch_size = GLOBAL_BATCH // dp
    model = model_for(tokenizer, arch, layers)
    if ref == "path":  # the model by name: TRL loads it, and a second copy as the reference
        model = os.path.join(out_dir, "dpo_base")
        if not os.path.isdir(model) and int(os.environ.get("RANK", "0")) == 0:
            model_for(tokenizer, arch, layers).save_pretrained(model)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    elif ref == "copy":
        extra["ref_model"] = model_for(tokenizer, arch, layers)
    if pad_outside:  # after the models were built over the vocabulary: the new id is one past their embeddings
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(data()),
                  processing_class=tokenizer, callbacks=[Record()], **extra)
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"run-{resume}", "checkpoint-2") if resume else None)
    trainer.save_model(os.path.join(out_dir, case))
    pushed = push_without_network(trainer)
    reference = None
    if dpo:  # DPO's reference: its class, its elements held here / in all, the most bytes a rank holds
        held = trainer.ref_model
        if held is not None:
            from torch.distributed.tensor import DTensor

            params = list(held.parameters())
            locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
            nbytes = [sum(t.numel() * t.element_size() for t in locals_)]  # each rank's parameter bytes
            if torch.distributed.is_initialized():
                nbytes = nbytes * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(nbytes, nbytes[0])
            reference = {"class": type(held).__name__, "held": sum(t.numel() for t in locals_),
                         "whole": sum(p.numel() for p in params), "most_bytes": max(nbytes),
                         "trainable": sum(p.numel() for p in params if p.requires_grad)}
        else:
            reference = {"class": None}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out_dir, f"{case}.json"), "w") as f:
            json.dump({"logs": logs, "eval": evaluated, "reference": reference, "pushed": pushed}, f)


def push_without_network(trainer) -> list[str] | None:
    """``trainer.push_to_hub()`` with the Hub replaced by a recorder: the files it would upload from output_dir
    (rank 0's list; None on the other ranks, which upload nothing)."""
    import fnmatch

    import transformers.trainer as hf_trainer

    uploaded = []

    class Hub:
        def upload_folder(self, folder_path, ignore_patterns=(), **kwargs):
            for root, dirs, files in os.walk(folder_path):
                dirs[:] = [d for d in dirs if not any(fnmatch.fnmatch(d, p) for p in ignore_patterns)]
                uploaded.extend(os.path.relpath(os.path.join(root, f), folder_path) for f in files
                                if not any(fnmatch.fnmatch(f, p) for p in ignore_patterns))

    real, hf_trainer.hf_api = hf_trainer.hf_api, Hub
    trainer.hub_model_id = "tests/tiny"  # a repository that "exists": no create_repo
    try:
        trainer.push_to_hub()
    finally:
        hf_trainer.hf_api = real
    return sorted(uploaded) if trainer.is_world_process_zero() else None


def main() -> None:
    tokenizer_dir, out_dir, *cases = sys.argv[1:]
    for case in cases:
        run(tokenizer_dir, out_dir, case)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


if __name__ == "__main__":
    main()

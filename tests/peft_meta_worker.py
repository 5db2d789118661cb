"""PEFT models built on the meta device, parallelized under ZeRO-3 (see tests/test_peft_meta.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/peft_meta_worker.py OUT.json LLAMA_DIR MOE_DIR

Each case builds the base on the meta device, wraps it with ``peft.get_peft_model`` and parallelizes it on 2 ranks
(ZeRO-3): loaded shard by shard from a directory ``save_pretrained`` wrote (a tiny Llama; a tiny Qwen3-MoE, whose
files hold the experts one by one and the model fuses them), or initialized from the seed ("scratch"). Rank 0
builds the same PEFT model in one process — from the loaded base (``from_pretrained`` + ``get_peft_model``), or
from the plain model initialized with the same seed — gives its adapters the engine's draws for that seed
(``initialize.init_introduced``), and compares: the whole state dict before training, then 3 training steps
(losses, the trained weights) with SGD + momentum and clipping active.
"""
from __future__ import annotations

import os
import sys
import types
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import padded_batches, rows  # noqa: E402

import ultrascale_plugins as us  # noqa: E402

warnings.filterwarnings("ignore")
STEPS, LR, MOMENTUM, CLIP, SEED = 3, 0.1, 0.9, 0.05, 1234
LAYOUT = {"dp_shard": 2, "zero_stage": 3}

# name: (LoraConfig fields, where the base comes from[, the model: "llama" unless "moe"])
CASES = {
    # all-linear LoRA and a trained copy of the head (PEFT's modules_to_save), from the pretrained directory; the
    # engine finds the directory itself (the config was read from it) and seeds the adapters by torch.initial_seed()
    "pretrained_lora_head": ({"target_modules": "all-linear", "modules_to_save": ["lm_head"]}, "auto"),
    # DoRA (its magnitude is the norm of the loaded base weight) with rsLoRA's scaling, the seed passed explicitly
    "pretrained_dora_rslora": ({"target_modules": "all-linear", "use_dora": True, "use_rslora": True}, "explicit"),
    # no pretrained weights: the base gets the plain model's values for the seed; LoRA on the embedding too
    "scratch_embedding": ({"target_modules": ["embed_tokens", "q_proj", "v_proj"]}, "scratch"),
    # all-linear on a mixture of experts: PEFT wraps each layer's fused expert tensors, which the files hold per
    # expert (the loader assembles them as transformers does)
    "pretrained_moe_all_linear": ({"target_modules": "all-linear"}, "explicit", "moe"),
}


def lora_config(fields: dict):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **fields)


def meta_base(hf_dir: str, scratch: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    if scratch:  # the same architecture, not read from the directory: nothing to load
        config = AutoConfig.for_model(config.model_type, **{k: v for k, v in config.to_dict().items()
                                                              if k not in ("model_type", "_name_or_path")})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def reference_model(hf_dir: str, fields: dict, scratch: bool):
    """The same PEFT model in one process, with real weights throughout."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.core.initialize import ModelInit, init_introduced

    if scratch:  # the plain model as the engine initializes it for SEED, in one process
        base = meta_base(hf_dir, scratch=True)
        ModelInit(base, seed=SEED, pm=us.get_plugin_manager()).load(types.SimpleNamespace(modules=[base], device=torch.device("cpu")), {})
    else:
        base = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    torch.manual_seed(99)  # get_peft_model draws the adapters from the global generator: init_introduced replaces them
    model = get_peft_model(base, lora_config(fields))
    introduced = init_introduced(model, SEED, pm=us.get_plugin_manager())
    return model, introduced


def train(step_fn, batches) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for batch in batches:
        loss, norm = step_fn(batch)
        losses.append(loss)
        norms.append(norm)
    return losses, norms


def run(name: str, dirs: dict) -> dict | None:
    from peft import get_peft_model

    from ultrascale_plugins.checkpoints.load import weights_for

    fields, source, *arch = CASES[name]
    hf_dir = dirs[arch[0] if arch else "llama"]
    model = get_peft_model(meta_base(hf_dir, scratch=source == "scratch"), lora_config(fields))
    assert all(p.is_meta for p in model.parameters())
    if source == "explicit":
        torch.manual_seed(5)  # not the adapters' seed: the one passed below is
        weights = weights_for(model, hf_dir, seed=SEED)
    else:
        torch.manual_seed(SEED)  # parallelize picks the initializer, seeded by torch.initial_seed()
        weights = None
    pmodel = us.parallelize(model, us.ParallelConfig(**LAYOUT), init_weights=weights)
    start = pmodel.full_state_dict()
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    batches = padded_batches(STEPS)

    def parallel_step(batch):
        loss = pmodel.train_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size))
        norm = float(pmodel.clip_grad_norm_(CLIP))
        opt.step()
        opt.zero_grad()
        return loss.item(), norm

    losses, norms = train(parallel_step, batches)
    final = pmodel.full_state_dict()
    if dist.get_rank() != 0:
        return None
    ref, introduced = reference_model(hf_dir, fields, scratch=source == "scratch")
    ref_start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.SGD(trainable, lr=LR, momentum=MOMENTUM)

    def reference_step(batch):
        loss = ref(**batch, use_cache=False).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(trainable, CLIP))
        ref_opt.step()
        ref_opt.zero_grad()
        return loss.item(), norm

    ref_losses, ref_norms = train(reference_step, batches)
    ref_final = ref.state_dict()
    keys = sorted(set(start) & set(ref_start))
    lora_b = [k for k in introduced if "lora_B" in k or "lora_embedding_A" in k]  # PEFT's zeros
    lora_a = [k for k in introduced if "lora_A" in k or "lora_embedding_B" in k]  # PEFT's draws
    from_file = {}
    if source != "scratch":  # the base and the head's copies hold the file's tensors
        from safetensors.torch import load_file

        files = {}
        for f in sorted(os.listdir(hf_dir)):
            if f.endswith(".safetensors"):
                files.update(load_file(os.path.join(hf_dir, f)))
        head = files["lm_head.weight"]
        from_file = {"q_proj": torch.equal(start["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
                                           files["model.layers.0.self_attn.q_proj.weight"]),
                     "head_copies": [torch.equal(v, head) for k, v in start.items() if k.startswith("base_model.model."
                                                                                               "lm_head.")]}
        experts = [k for k in start if k.endswith("experts.base_layer.base_layer.down_proj")]
        if experts:  # expert e's down_proj, as the files hold it
            from_file["experts"] = [torch.equal(start[k][e], files[k.replace("base_model.model.", "").replace(
                ".base_layer", "").replace("experts.down_proj", f"experts.{e}.down_proj.weight")])
                for k in experts for e in range(start[k].shape[0])]
    return {"keys_equal": set(start) == set(ref_start), "introduced": len(introduced),
            "start_diff": max((start[k] - ref_start[k]).abs().max().item() for k in keys),
            "start_unequal": [k for k in keys if not torch.equal(start[k], ref_start[k])][:5],
            "b_zero": all(start[k].abs().max().item() == 0 for k in lora_b) and bool(lora_b),
            "a_nonzero": all(start[k].abs().max().item() > 0 for k in lora_a) and bool(lora_a),
            "magnitudes": [k for k in introduced if "magnitude" in k],
            "losses": losses, "ref_losses": ref_losses,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "clipped": all(n > CLIP for n in ref_norms),
            "norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "final_diff": max((final[k] - ref_final[k]).abs().max().item() for k in keys),
            "trained": max((final[k] - start[k]).abs().max().item() for k in introduced),
            "from_file": from_file}


def main() -> None:
    from peft_worker import run_cases

    dirs = {"llama": sys.argv[2], "moe": sys.argv[3]}
    run_cases(sys.argv[1], list(CASES), lambda name: run(name, dirs), "peft_meta")


if __name__ == "__main__":
    main()

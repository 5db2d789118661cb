"""PEFT (LoRA) models under the package's layouts against the same PEFT model in one process (see tests/test_peft.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/peft_worker.py OUT.json CASE...

Each case builds a tiny model, wraps it with ``peft.get_peft_model`` (LoRA on every linear layer,
``lora_dropout=0``), trains it under the case's layout with SGD + momentum and clipping active, and compares on
rank 0 with the same PEFT model trained in one process: losses, global gradient norms, the adapters' weights; and
that the frozen base is bit-identical to where it started and holds no gradient or optimizer state.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_config, packed_batches, padded_batches, rows  # noqa: E402
from parity_worker import holdings  # noqa: E402

import ultrascale_plugins as us  # noqa: E402

warnings.filterwarnings("ignore")
STEPS, LR, MOMENTUM, CLIP = 4, 0.1, 0.9, 0.05

CASES = {
    "zero3_llama": ("llama", {"dp_shard": 2, "zero_stage": 3}, {"save": True}),
    "zero2_qwen2": ("qwen2", {"dp_shard": 2, "zero_stage": 2}, {}),
    "zero1_llama_head": ("llama", {"dp_shard": 2, "zero_stage": 1}, {"modules_to_save": ["lm_head"]}),
    "ddp_qwen3_moe": ("qwen3_moe", {"dp_shard": 2, "zero_stage": 0}, {}),
    "zero3_qwen3_moe_ac": ("qwen3_moe", {"dp_shard": 2, "activation_checkpointing": "full"}, {}),
    "cp2_ring_llama": ("llama", {"cp": 2}, {"data": "packed", "save": True}),
    "cp2_ulysses_qwen2": ("qwen2", {"cp": 2, "cp_method": "ulysses"}, {"data": "packed"}),
    "zero3_dora_llama": ("llama", {"dp_shard": 2}, {"use_dora": True}),
    # LoRA on the embedding (PEFT's lora.Embedding), rank-stabilized scaling (rsLoRA)
    "zero3_embedding_rslora_llama": ("llama", {"dp_shard": 2},
                                     {"target_modules": ["embed_tokens", "q_proj", "v_proj"], "use_rslora": True}),
    "ddp_dora_llama": ("llama", {"dp_shard": 2, "zero_stage": 0}, {"use_dora": True}),
    # a bf16 frozen base with fp32 adapters (PEFT's autocast_adapter_dtype) under FSDP2, against the fp32 run
    "zero3_bf16_base_llama": ("llama", {"dp_shard": 2}, {"base_dtype": "bf16", "tol": 2e-2}),
    # a bf16 base with a mixed-dtype trainable set in one FSDP2 group (the root: fp32 LoRA on the embedding beside
    # PEFT's bf16 copy of the head)
    "zero3_bf16_mixed_trainable_llama": ("llama", {"dp_shard": 2},
                                         {"base_dtype": "bf16", "tol": 2e-2, "modules_to_save": ["lm_head"],
                                          "target_modules": ["embed_tokens", "q_proj", "v_proj"]}),
    # the recipes' LoRA (a bf16 base) with the chunked loss on its frozen head
    "zero3_chunked_bf16_base_llama": ("llama", {"dp_shard": 2, "chunked_loss": 24}, {"base_dtype": "bf16", "tol": 2e-2}),
    # PEFT's task_type="CAUSAL_LM" (PeftModelForCausalLM, most users' choice): its forward hands the labels on
    "zero3_task_causal_lm_llama": ("llama", {"dp_shard": 2}, {"task_type": "CAUSAL_LM", "save": True}),
    "cp2_ring_task_causal_lm_qwen2": ("qwen2", {"cp": 2}, {"task_type": "CAUSAL_LM", "data": "packed"}),
    # tensor parallel: each adapter follows its base layer (column-wise: B sharded; row-wise: A sharded)
    "tp2_llama": ("llama", {"tp": 2, "dp_shard": 1},  # LoRA on the head too: B follows its gathered column-wise style
                  {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                      "lm_head"]}),
    "tp2_sp_qwen2_head": ("qwen2", {"tp": 2, "dp_shard": 1, "sequence_parallel": True},
                          {"modules_to_save": ["lm_head"], "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                             "gate_proj", "up_proj", "down_proj",
                                                                             "embed_tokens"]}),
    # four processes (FOUR): ZeRO-3 x TP + SP; HSDP (replicated over one axis, sharded over the other); CP x TP + SP
    "zero3_tp2_sp_llama": ("llama", {"dp_shard": 2, "tp": 2, "sequence_parallel": True},
                           {"save": True, "task_type": "CAUSAL_LM"}),
    "hsdp_qwen2": ("qwen2", {"dp_replicate": 2, "dp_shard": 2}, {}),
    "cp2_tp2_sp_qwen2": ("qwen2", {"cp": 2, "cp_method": "ulysses", "tp": 2, "sequence_parallel": True},
                         {"data": "packed"}),
    # a base loaded with from_pretrained: transformers re-kernelized it on train(), resetting the norms' SP forwards
    "tp2_sp_pretrained_llama": ("pretrained_llama", {"tp": 2, "dp_shard": 1, "sequence_parallel": True}, {}),
    "tp2_sp_qwen3_moe": ("qwen3_moe", {"tp": 2, "dp_shard": 1, "sequence_parallel": True},
                         {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
}
FOUR = ("zero3_tp2_sp_llama", "hsdp_qwen2", "cp2_tp2_sp_qwen2")


def base_model(arch: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch.startswith("pretrained_"):  # as users load one: from_pretrained (eval mode, transformers' hub kernels on)
        import tempfile

        from safetensors.torch import save_file

        model = base_model(arch.removeprefix("pretrained_"))
        if torch.get_default_device().type == "meta":  # the estimate's twin: the same structure
            return model
        with tempfile.TemporaryDirectory() as tmp:  # written by this process (save_pretrained writes on rank 0 only)
            model.config.save_pretrained(tmp)
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{tmp}/model.safetensors")
            return AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa")
    if arch == "qwen3_moe":
        config = AutoConfig.for_model("qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
                                      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    else:
        config = make_config(arch.removeprefix("tied_"))
        config.max_position_embeddings = 256
        config.tie_word_embeddings = arch.startswith("tied_")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def peft_model(arch: str, extra: dict):
    from peft import LoraConfig, get_peft_model

    model = base_model(arch)
    if extra.get("base_dtype") == "bf16":
        model = model.to(torch.bfloat16)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=extra.get("target_modules", "all-linear"),
                        modules_to_save=extra.get("modules_to_save"), use_dora=extra.get("use_dora", False),
                        use_rslora=extra.get("use_rslora", False), task_type=extra.get("task_type"))
    return get_peft_model(model, config)


def batches(extra: dict):
    return packed_batches(STEPS, seq_len=64) if extra.get("data") == "packed" else padded_batches(STEPS)


def trainable_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def reference(arch: str, extra: dict) -> dict:
    model = peft_model(arch, {k: v for k, v in extra.items() if k != "base_dtype"})
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for batch in batches(extra):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def run(name: str) -> dict | None:
    arch, layout, extra = CASES[name]
    model = peft_model(arch, extra)
    trainable = trainable_names(model)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pmodel = us.parallelize(model, us.ParallelConfig(**layout))
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for batch in batches(extra):
        loss = pmodel.train_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size))
        norms.append(float(pmodel.clip_grad_norm_(CLIP)))
        opt.step()
        if len(losses) == STEPS - 1:  # gradients and momentum exist now: none may belong to the frozen base
            held = holdings(pmodel, opt)
            frozen_with_state = sorted(
                n for n, p in pmodel.named_parameters() if n not in trainable
                and (p.grad is not None or opt.state.get(p) or p.requires_grad))
        opt.zero_grad()
        losses.append(loss.item())
    bytes_held = [None] * dist.get_world_size()  # each rank's holdings against the estimate for its coordinates
    dist.all_gather_object(bytes_held, (held, predicted(pmodel, arch, extra)))
    final = pmodel.full_state_dict()
    placements = {n: dict(zip(param.device_mesh.mesh_dim_names, map(str, param.placements)))
                  for n, param in pmodel.named_parameters()
                  if "lora_" in n and "layers.0.self_attn" in n and hasattr(param, "placements")}
    saved = None
    if extra.get("save"):  # the adapters in PEFT's format, as the front ends' save_model writes them
        from ultrascale_plugins.integrations.hf_module import ParallelCausalLM

        saved = extra["save"] + "/" + name
        ParallelCausalLM(pmodel).save_pretrained(saved)
    if dist.get_rank() != 0:
        return None
    ref = reference(arch, extra)
    keys = set(final) & set(ref["state"])
    adapters = [k for k in keys if "lora_" in k or "modules_to_save" in k]
    base = [k for k in keys if k not in adapters]
    loaded = reloaded_adapter_diff(arch, extra, saved, final, adapters) if saved else None
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref["losses"])), "reloaded": loaded,
            "bytes_held": bytes_held,
            "norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, ref["norms"])),
            "clipped": all(n > CLIP for n in ref["norms"]),
            "adapter_diff": max((final[k].float() - ref["state"][k].float()).abs().max().item() for k in adapters),
            "adapters": len(adapters), "trainable": len(trainable),
            "base_unchanged": all(torch.equal(final[k], start[k]) for k in base),
            "keys_equal": set(final) == set(ref["state"]), "frozen_with_state": frozen_with_state,
            "losses": losses, "ref_losses": ref["losses"], "placements": placements}


def predicted(pmodel, arch: str, extra: dict) -> dict:
    """The estimate's parameter, gradient and optimizer bytes for this rank, from the PEFT model on the meta
    device (its inventory knows which parameters train)."""
    mesh = pmodel.dims.mesh
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())) if mesh is not None else {}
    with torch.device("meta"):
        model = peft_model(arch, extra)
    est = us.estimate(pmodel.config, model.config, world_size=dist.get_world_size(), coords=coords, model=model,
                      optimizer="sgd_momentum", check=False)
    return {k: int(est.memory[k]) for k in ("params", "grads", "optimizer")}


def reloaded_adapter_diff(arch: str, extra: dict, saved: str, final: dict, adapters: list[str]) -> dict:
    """``PeftModel.from_pretrained(base, saved)`` on a fresh base: its adapters against the run's, and the files."""
    import os

    from peft import PeftModel

    model = PeftModel.from_pretrained(base_model(arch), saved)
    state = model.state_dict()
    return {"files": sorted(os.listdir(saved)),
            "max_diff": max((state[k].float() - final[k].float()).abs().max().item() for k in adapters)}


def resume(directory: str) -> dict:
    """ZeRO-3: save a sharded checkpoint after 2 steps, go on to the end; a fresh PEFT model (another seed for its
    adapters) loads it and continues: bit for bit the same losses."""
    from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint

    layout = us.ParallelConfig(dp_shard=2)
    data = batches({})

    pmodel = us.parallelize(peft_model("llama", {}), layout)
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3)
    first = train_steps(pmodel, opt, data, range(2))
    ckpt = save_checkpoint(pmodel, opt, directory, step=2)
    rest = train_steps(pmodel, opt, data, range(2, STEPS))
    torch.manual_seed(7)
    fresh = us.parallelize(peft_model("llama", {}), layout)
    opt = fresh.build_optimizer(torch.optim.AdamW, lr=1e-3)
    load_checkpoint(fresh, opt, ckpt)
    return {"uninterrupted": first + rest, "resumed": train_steps(fresh, opt, data, range(2, STEPS))}


def train_steps(pmodel, opt, data, which) -> list[float]:
    """Steps ``which`` of the global batches ``data``, each rank on its rows, clipping at CLIP: the losses."""
    out = []
    for i in which:
        out.append(pmodel.train_step(rows(data[i], pmodel.data_parallel_rank, pmodel.data_parallel_size)).item())
        pmodel.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
    return out


def run_cases(out: str, names, run_one, tag: str, cases: dict | None = None) -> None:
    """The workers' launch: each case in turn (``run_one(name)``); rank 0 writes {name: result} to ``out``. A case
    of ``cases`` that saves its adapters saves them beside ``out``."""
    for name in names:
        if name in (cases or {}) and cases[name][2].get("save"):
            cases[name][2]["save"] = os.path.dirname(os.path.abspath(out))
    us.init_distributed(timeout=120)
    results = {}
    for name in names:
        print(f"[{tag}] case {name}", file=sys.stderr, flush=True)
        results[name] = run_one(name)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    ckpt = os.path.dirname(os.path.abspath(out)) + "/ckpt"
    run_cases(out, names, lambda name: resume(ckpt) if name == "resume" else run(name), "peft", CASES)


if __name__ == "__main__":
    main()

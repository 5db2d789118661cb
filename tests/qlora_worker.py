"""A PEFT model on a quantized frozen base (QLoRA: torchao's NF4Tensor, ``features/peft/quantized_base.quantize_base``)
under the package's layouts, against the same quantized PEFT model trained in one process (see tests/test_qlora.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/qlora_worker.py OUT.json CASE...

Each case builds a small model (hidden 256: every linear weight holds whole 64 x 256 NF4 scale blocks per rank at
QLoRA's default block sizes), wraps it with LoRA on every linear layer, quantizes the base, trains it under the
case's layout with SGD + momentum and clipping active, and compares on rank 0 with the one-process run: losses,
global gradient norms, adapters; the NF4 base after training is the NF4 base it started from (all its inner
tensors, gathered); it stays NF4 on every rank, holds no gradient or optimizer state, and each rank holds only its
shard of the packed 4-bit data.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import packed_batches, padded_batches, rows  # noqa: E402

from peft_worker import run_cases, train_steps  # noqa: E402

import ultrascale_plugins as us  # noqa: E402
from ultrascale_plugins.features.peft.quantized_base import (  # noqa: E402
    gathered, quantize_base, quantized_bytes, quantized_weights)

warnings.filterwarnings("ignore")
STEPS, LR, MOMENTUM, CLIP = 4, 0.1, 0.9, 0.05
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")

CASES = {
    "zero3_llama": ("llama", {"dp_shard": 2, "zero_stage": 3}, {"save": True}),
    "zero2_qwen2": ("qwen2", {"dp_shard": 2, "zero_stage": 2}, {}),  # q/k/v biases stay float next to NF4
    "zero1_llama": ("llama", {"dp_shard": 2, "zero_stage": 1}, {}),
    "ddp_llama": ("llama", {"dp_shard": 2, "zero_stage": 0}, {}),
    "zero3_ac_qwen2": ("qwen2", {"dp_shard": 2, "activation_checkpointing": "full"}, {}),
    "cp2_ring_llama": ("llama", {"cp": 2}, {"data": "packed"}),
    # a bf16 base quantized to NF4 (bf16 scales, bf16 matmuls) with fp32 adapters, against the same in one process
    "zero3_bf16_llama": ("llama", {"dp_shard": 2}, {"base_dtype": "bf16", "tol": 1e-3}),
    "zero3_offload_llama": ("llama", {"dp_shard": 2, "cpu_offload": True}, {}),
    "ddp_bf16_llama": ("llama", {"dp_shard": 2, "zero_stage": 0}, {"base_dtype": "bf16", "tol": 1e-3}),
}


def base_model(arch: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def qlora_model(arch: str, extra: dict, seed: int = 0, adapter_seed: int = 1, scale_q_proj: float = 1.0):
    """LoRA on every linear layer of a base model, its base quantized to NF4 (``scale_q_proj``: the first layer's
    q_proj weight scaled before quantization, the only difference from the same base)."""
    from peft import LoraConfig, get_peft_model

    model = base_model(arch, seed)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(scale_q_proj)
    if extra.get("base_dtype") == "bf16":
        model = model.to(torch.bfloat16)
    torch.manual_seed(adapter_seed)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    return quantize_base(model, "nf4")


def batches(extra: dict):
    return packed_batches(STEPS, seq_len=64) if extra.get("data") == "packed" else padded_batches(STEPS)


_references: dict = {}


def reference(arch: str, extra: dict) -> dict:
    """The same quantized PEFT model trained in one process (computed once per model and data)."""
    key = (arch, extra.get("base_dtype"), extra.get("data"))
    if key not in _references:
        model = qlora_model(arch, extra)
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
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
        _references[key] = {"losses": losses, "norms": norms, "state": state}
    return _references[key]


def inner(weight) -> dict:
    """An NF4 weight's inner tensors, and the value they stand for (dequantized)."""
    return {**{n: getattr(weight, n).detach().clone() for n in INNER}, "value": weight.get_original_weight()}


def run(name: str) -> dict | None:
    from torch.distributed.tensor import DTensor

    arch, layout, extra = CASES[name]
    model = qlora_model(arch, extra)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    start = {n: inner(w) for n, w in quantized_weights(model).items()}
    pmodel = us.parallelize(model, us.ParallelConfig(**layout))
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    for batch in batches(extra):
        loss = pmodel.train_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size))
        norms.append(float(pmodel.clip_grad_norm_(CLIP)))
        opt.step()
        if len(losses) == STEPS - 1:  # gradients and momentum exist now: none may belong to the frozen base
            frozen_with_state = sorted(
                n for n, p in pmodel.named_parameters() if n not in trainable
                and (p.grad is not None or opt.state.get(p) or p.requires_grad))
        opt.zero_grad()
        losses.append(loss.item())
    # the base after training, as each rank holds it and gathered whole: the NF4 base it started from
    params = dict(pmodel.named_parameters())
    still_nf4, dtypes, base_unchanged, data_bytes, numel = [], set(), True, 0, 0
    for n, start_inner in start.items():
        p = params[n]
        local = p.to_local() if isinstance(p, DTensor) else p
        still_nf4.append(type(local).__name__ == "NF4Tensor" and not p.requires_grad)
        dtypes.add(str(local.dtype))
        data_bytes += local.quantized_data.numel() * local.quantized_data.element_size()
        numel += p.numel()
        whole = gathered(p)  # not torchao's asynchronous NF4 all-gather: it corrupts the heap over gloo
        base_unchanged &= all(torch.equal(getattr(whole, k), v) for k, v in start_inner.items() if k != "value")
        base_unchanged &= torch.equal(whole.get_original_weight(), start_inner["value"])
    held = {"nf4_bytes": quantized_bytes(pmodel.parameters()), "packed_data_bytes": data_bytes, "numel": numel,
            # what the same weights take in bf16 on this rank: sharded as FSDP2 shards, whole under DDP / CP
            "bf16_bytes": numel * 2 // (pmodel.dims.facts.fsdp_shards),
            "shards": pmodel.dims.facts.fsdp_shards, "dtypes": sorted(dtypes)}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (held, all(still_nf4), len(still_nf4), base_unchanged))
    final = pmodel.full_state_dict()
    saved = None
    if extra.get("save"):  # the adapters in PEFT's format, as the front ends' save_model writes them
        from ultrascale_plugins.integrations.hf_module import ParallelCausalLM

        saved = extra["save"] + "/" + name
        ParallelCausalLM(pmodel).save_pretrained(saved)
    if dist.get_rank() != 0:
        return None
    ref = reference(arch, extra)
    adapters = sorted(ref["state"])
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
            "norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, ref["norms"])),
            "clipped": all(n > CLIP for n in ref["norms"]),
            "adapter_diff": max((final[k].float() - ref["state"][k].float()).abs().max().item() for k in adapters),
            "adapters": len(adapters), "trainable": len(trainable), "keys_equal": set(final) == set(model.state_dict()),
            "per_rank": per_rank, "frozen_with_state": frozen_with_state,
            "reloaded": reloaded_adapter_diff(arch, saved, final, adapters) if saved else None,
            "losses": losses, "ref_losses": ref["losses"]}


def reloaded_adapter_diff(arch: str, saved: str, final: dict, adapters: list[str]) -> dict:
    """``PeftModel.from_pretrained(base, saved)`` on a fresh (unquantized) base: its adapters against the run's."""
    from peft import PeftModel

    state = PeftModel.from_pretrained(base_model(arch), saved).state_dict()
    return {"files": sorted(os.listdir(saved)),
            "max_diff": max((state[k].float() - final[k].float()).abs().max().item() for k in adapters)}


def resume(directory: str) -> dict:
    """ZeRO-3: a sharded checkpoint after 2 steps (the adapters and their optimizer state; the frozen base is left
    out and fingerprinted: features/peft/checkpoints), then on to the end. A fresh model on the same quantized base
    (other adapters) loads it and continues bit for bit; one whose base differs in a single NF4 weight is refused
    before anything is read.
    Errors are recorded (the other cases' results survive them)."""
    import traceback

    from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint

    layout = us.ParallelConfig(dp_shard=2)
    data = batches({})

    def steps(pmodel, opt, which):
        return train_steps(pmodel, opt, data, which)

    try:
        pmodel = us.parallelize(qlora_model("llama", {}), layout)
        opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3)
        first = steps(pmodel, opt, range(2))
        ckpt = save_checkpoint(pmodel, opt, directory, step=2)
        rest = steps(pmodel, opt, range(2, STEPS))
        fresh = us.parallelize(qlora_model("llama", {}, adapter_seed=8), layout)
        opt = fresh.build_optimizer(torch.optim.AdamW, lr=1e-3)
        load_checkpoint(fresh, opt, ckpt)
        resumed = steps(fresh, opt, range(2, STEPS))
        other = us.parallelize(qlora_model("llama", {}, scale_q_proj=1.01), layout)  # differs in one NF4 weight
        opt = other.build_optimizer(torch.optim.AdamW, lr=1e-3)
        try:
            load_checkpoint(other, opt, ckpt)
            refused = None
        except Exception as exc:  # noqa: BLE001 - the message is checked by the test
            refused = f"{type(exc).__name__}: {exc}"
        return {"uninterrupted": first + rest, "resumed": resumed, "other_base": refused}
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()[-3000:]}


def meta_build(directory: str) -> dict:
    """The base quantized on the meta device, as the command line builds a QLoRA model (no rank ever holds the
    whole model): ``quantize_base`` records the quantization, ``parallelize`` gives each weight its value whole and
    keeps this rank's part of its quantization. From pretrained files (``init_from``, a bf16 base): the gathered
    NF4 base against the same files loaded whole and quantized in one process, and the first loss (LoRA's B starts
    at zero: the base alone) against that model's. From the seed: against the same meta build without quantization,
    quantized whole afterwards. Errors are recorded."""
    import traceback

    from peft import LoraConfig, get_peft_model
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.features.peft.quantized_base import requantized

    def meta_model(config, quantized: bool):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        return quantize_base(model, "nf4") if quantized else model

    def same_nf4(a, b) -> bool:
        return all(torch.equal(getattr(a, k), getattr(b, k)) for k in INNER)

    try:
        base = base_model("llama").to(torch.bfloat16)
        if dist.get_rank() == 0:
            base.save_pretrained(directory)
        dist.barrier()
        layout = us.ParallelConfig(dp_shard=2)
        pmodel = us.parallelize(meta_model(base.config, True), layout, init_from=directory)
        ref = qlora_model("llama", {"base_dtype": "bf16"})  # the same files' values, quantized whole
        ref_params = dict(ref.named_parameters())
        nf4, equal = 0, True
        for name, p in pmodel.named_parameters():
            if "lora_" in name:
                continue
            mine, theirs = gathered(p), ref_params[name]
            nf4 += type(theirs).__name__ == "NF4Tensor"
            equal &= same_nf4(mine, theirs) if type(theirs).__name__ == "NF4Tensor" else torch.equal(mine, theirs)
        batch = batches({})[0]
        first = pmodel.train_step(rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size)).item()
        with torch.no_grad():
            ref_first = ref(**batch, use_cache=False).loss.item()
        torch.manual_seed(5)
        seeded = us.parallelize(meta_model(base.config, True), layout)
        torch.manual_seed(5)
        plain = dict(us.parallelize(meta_model(base.config, False), layout).named_parameters())
        seeded_nf4, seeded_equal = 0, True
        for name, p in seeded.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if type(local).__name__ == "NF4Tensor":
                seeded_nf4 += 1
                seeded_equal &= same_nf4(gathered(p), requantized(local, gathered(plain[name])))
            else:
                seeded_equal &= torch.equal(gathered(p), gathered(plain[name]))
        return {"nf4": nf4, "equal": bool(equal), "first_loss": first, "ref_first_loss": ref_first,
                "seeded_nf4": seeded_nf4, "seeded_equal": bool(seeded_equal)}
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()[-3000:]}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    here = os.path.dirname(os.path.abspath(out))
    special = {"resume": lambda: resume(here + "/ckpt"), "meta_build": lambda: meta_build(here + "/base")}
    run_cases(out, names, lambda name: special[name]() if name in special else run(name), "qlora", CASES)


if __name__ == "__main__":
    main()

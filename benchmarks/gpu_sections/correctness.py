"""Correctness on one device (world size 1): each check compares two code paths that must agree and records its
largest difference, the tolerance and pass/fail."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import ultrascale_plugins as us

from .common import (TOL_ADAMW, TOL_BF16_REL, TOL_FP32, TOL_INIT_STD, Recorder, Sizes, device,
                     free_memory, max_abs_diff, max_state_diff, random_batches, small_llama, small_llama_config,
                     train_losses)

MOE_BF16_RATIO = 1.5  # the engine's bf16 gradients may be at most this much further from fp32 than transformers'
LR = 1e-4  # small steps: two implementations' trajectories stay comparable over a few steps


def _train(sizes: Sizes, fields: dict, seed: int = 0, batches=None) -> list[float]:
    import ultrascale_plugins as us

    batches = batches or random_batches(sizes.steps, sizes.rows, sizes.seq, sizes.small["vocab_size"])
    pmodel = us.parallelize(small_llama(sizes, seed), us.ParallelConfig(**fields))
    optimizer = pmodel.build_optimizer(torch.optim.AdamW, lr=LR)
    losses = train_losses(pmodel, optimizer, batches)
    del pmodel, optimizer
    free_memory()
    return losses


def _relative(losses, reference) -> float:
    return max_abs_diff(losses, reference) / max(abs(x) for x in reference)


# ---- bf16 vs fp32 ------------------------------------------------------------------------------------------
def bf16_vs_fp32(rec: Recorder, sizes: Sizes) -> None:
    fp32 = _train(sizes, {"mixed_precision": "no"})
    bf16 = _train(sizes, {"mixed_precision": "bf16"})
    rec.check("bf16 vs fp32 losses (relative)", _relative(bf16, fp32), TOL_BF16_REL, steps=len(fp32),
              loss_fp32=fp32[-1], loss_bf16=bf16[-1])


# ---- meta-device build, initialized on the device ----------------------------------------------------------
def _reference_init(cfg, seed: int) -> dict:
    """The weights ``ModelInit`` gives ``seed``, drawn whole on the CPU without any layout or device."""
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.core.initialize import ModelInit

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    init = ModelInit(model, seed=seed, pm=us.get_plugin_manager())
    state = {}
    for unit, names in init.units.items():
        values = init.unit_values(unit)
        state.update({f"{unit}.{name}" if unit else name: values[name] for name in names})
    return state


def _std_deviation(state: dict, initializer_range: float) -> float:
    """Largest relative deviation of a weight matrix's std from the config's initializer_range (transformers draws
    every Linear and Embedding weight from N(0, initializer_range))."""
    stds = [t.float().std().item() for name, t in state.items() if t.dim() == 2]
    return max(abs(s - initializer_range) / initializer_range for s in stds)


def meta_init(rec: Recorder, sizes: Sizes) -> None:
    import ultrascale_plugins as us
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.checkpoints.load import weights_for

    cfg, seed = small_llama_config(sizes), 1234
    torch.manual_seed(seed)  # as the CLI does: the initializer takes torch.initial_seed()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    pmodel = us.parallelize(model, us.ParallelConfig(), init_weights=weights_for(model, None))
    dev = pmodel.device
    state = {k: v for k, v in pmodel.full_state_dict().items() if k in dict(model.named_parameters())}
    reference = _reference_init(cfg, seed)
    rec.check("meta build initialized on device == CPU init (weights)", max_state_diff(state, reference), 0.0,
              device=str(dev), tensors=len(reference))
    rec.check("initialized weight std vs initializer_range (relative)",
              _std_deviation(reference, cfg.initializer_range), TOL_INIT_STD, initializer_range=cfg.initializer_range)
    # the same weights in a plain transformers model on the device: equal evaluation losses
    plain = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    plain.load_state_dict(reference, strict=False)  # buffers (rotary frequencies) are the model's own
    plain.to(dev).eval()
    batch = random_batches(1, sizes.rows, sizes.seq, cfg.vocab_size)[0]
    with torch.no_grad():
        expected = plain(**{k: v.to(dev) for k, v in batch.items()}).loss.item()
    got = pmodel.eval_step(batch).item()
    rec.check("meta-initialized model vs plain model, eval loss", abs(got - expected), TOL_FP32, loss=got)
    del pmodel, plain
    free_memory()


# ---- checkpoint save, resume, export -----------------------------------------------------------------------
def _logits(module, batch: dict, dev) -> torch.Tensor:
    with torch.no_grad():
        return module(input_ids=batch["input_ids"].to(dev), use_cache=False).logits.float().cpu()


def checkpoint(rec: Recorder, sizes: Sizes) -> None:
    import ultrascale_plugins as us
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.checkpoints.export import export_hf
    from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint

    half = max(1, sizes.steps // 2)
    batches = random_batches(2 * half, sizes.rows, sizes.seq, sizes.small["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        pmodel = us.parallelize(small_llama(sizes, 0), us.ParallelConfig())
        optimizer = pmodel.build_optimizer(torch.optim.AdamW, lr=LR)
        first = train_losses(pmodel, optimizer, batches[:half])
        path = save_checkpoint(pmodel, optimizer, Path(tmp) / "ckpt", step=half)
        uninterrupted = train_losses(pmodel, optimizer, batches[half:])
        del pmodel, optimizer
        free_memory()
        # other initial weights: everything the resumed run trains with must come from the checkpoint
        resumed_model = us.parallelize(small_llama(sizes, 7), us.ParallelConfig())
        optimizer = resumed_model.build_optimizer(torch.optim.AdamW, lr=LR)
        load_checkpoint(resumed_model, optimizer, path)
        dev = resumed_model.device
        at_save = _logits(resumed_model, batches[0], dev)
        resumed = train_losses(resumed_model, optimizer, batches[half:])
        rec.check("resumed losses == uninterrupted", max_abs_diff(resumed, uninterrupted), TOL_FP32,
                  steps_before=len(first), steps_after=len(resumed))
        exported = export_hf(path, Path(tmp) / "hf")
        plain = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="sdpa").to(dev).eval()
        rec.check("export reloads in transformers: logits", (_logits(plain, batches[0], dev) - at_save).abs().max()
                  .item(), TOL_FP32)
        del resumed_model, optimizer, plain
        free_memory()


# ---- AdamW implementations -----------------------------------------------------------------------------------
def adamw(rec: Recorder, sizes: Sizes) -> None:
    """The parity suite's AdamW check (for-loop vs foreach vs fused) on this device."""
    from models import padded_batches
    from parity_worker import adamw_implementations_agree

    for layout in ({}, {"mixed_precision": "bf16"}):
        result = adamw_implementations_agree("llama", {"layout": layout}, padded_batches(3))
        for kind, (loss_diff, weight_diff) in result.items():
            label = f"AdamW {kind} vs for-loop ({layout.get('mixed_precision', 'fp32')})"
            rec.check(label, max(loss_diff, weight_diff), TOL_ADAMW, loss_diff=loss_diff, weight_diff=weight_diff)
        free_memory()


# ---- torch.compile per decoder layer -----------------------------------------------------------------------
def compile_regional(rec: Recorder, sizes: Sizes) -> None:
    batches = random_batches(sizes.steps, sizes.rows, sizes.seq, sizes.small["vocab_size"])
    # the dry run compiles fp32 only: inductor on 2 CPU cores takes about half a minute per model
    for precision in ("no",) if sizes.dry_run else ("no", "bf16"):
        eager = _train(sizes, {"mixed_precision": precision}, batches=batches)
        compiled = _train(sizes, {"mixed_precision": precision, "compile": "regional"}, batches=batches)
        label = f"compile regional vs eager losses ({'fp32' if precision == 'no' else 'bf16, relative'})"
        if precision == "no":
            rec.check(label, max_abs_diff(compiled, eager), TOL_FP32, steps=len(eager))
        else:
            rec.check(label, _relative(compiled, eager), TOL_BF16_REL, steps=len(eager))


# ---- context-parallel attention kernels --------------------------------------------------------------------
def cp_kernels(rec: Recorder, sizes: Sizes) -> None:
    from cp_kernels import check_kernels

    dev = device()
    for dtype in (torch.float32, torch.bfloat16):
        for row in check_kernels(str(dev), dtype):
            extra = {k: v for k, v in row.items() if k not in ("kernel", "case", "ok", "reason")}
            name = f"{row.get('kernel')} {row.get('case')} {str(dtype).replace('torch.', '')}"
            if row.get("ok") is None:  # a kernel this device or build lacks: cp_kernels says why
                rec.skipped(name, str(row.get("reason", "no verdict from cp_kernels")), **extra)
            else:
                rec.add(name, "pass" if row["ok"] else "fail", **extra)


# ---- mixture of experts through the engine -----------------------------------------------------------------
def _moe_model(sizes: Sizes, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**sizes.moe), attn_implementation="sdpa")


def _grads(named_parameters) -> dict:
    from torch.distributed.tensor import DTensor

    from ultrascale_plugins.core.local_shards import unwrapped_name

    out = {}
    for name, p in named_parameters:
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[unwrapped_name(name)] = g.float().cpu()
    return out


def _grad_diff(grads: dict, reference: dict) -> float:
    """Largest |difference| of a gradient relative to the largest |entry| of its reference."""
    if set(grads) != set(reference):
        return float("inf")
    return max(((grads[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(1e-12)).item()
               for k in reference)


def _moe_run(sizes: Sizes, batch: dict, precision: str | None) -> tuple[float, dict, str | None]:
    """(loss, gradients, experts implementation) of one forward/backward: through ``parallelize`` (tp=1) with
    ``mixed_precision=precision``, or with ``precision`` None the plain transformers model (fp32)."""
    import ultrascale_plugins as us

    model = _moe_model(sizes)
    experts = getattr(model.config, "_experts_implementation", None)
    if precision is None:
        dev = device()
        model.to(dev).train()
        loss = model(**{k: v.to(dev) for k, v in batch.items()}, use_cache=False).loss
        loss.backward()
        out = loss.item(), _grads(model.named_parameters()), experts
    else:
        pmodel = us.parallelize(model, us.ParallelConfig(tp=1, mixed_precision=precision))
        out = pmodel.train_step(batch).item(), _grads(pmodel.named_parameters()), experts
        del pmodel
    del model
    free_memory()
    return out


def _plain_bf16(sizes: Sizes, batch: dict) -> dict:
    """transformers' own bf16 gradients (the model cast to bf16): how far bf16 alone moves them from fp32."""
    model = _moe_model(sizes).to(device(), dtype=torch.bfloat16).train()
    model(**{k: v.to(device()) for k, v in batch.items()}, use_cache=False).loss.backward()
    grads = _grads(model.named_parameters())
    del model
    free_memory()
    return grads


def moe(rec: Recorder, sizes: Sizes) -> None:
    """A tiny Qwen3-MoE through ``parallelize`` (tp=1) against the plain transformers model: loss and every
    gradient. fp32 must agree to TOL_FP32. In bf16 the small expert gradients of a fresh model are mostly rounding
    (bf16 alone moves them tens of percent from fp32), so the engine's bf16 gradients are judged by their distance
    from fp32 against that of transformers' own bf16 run."""
    batch = random_batches(1, sizes.rows, sizes.seq, sizes.moe["vocab_size"])[0]
    ref_loss, ref_grads, experts = _moe_run(sizes, batch, None)
    for precision in ("no", "bf16"):
        loss, grads, _ = _moe_run(sizes, batch, precision)
        label = "fp32" if precision == "no" else "bf16"
        tol = TOL_FP32 if precision == "no" else TOL_BF16_REL
        rec.check(f"MoE loss vs plain fp32 model ({label}, relative)", abs(loss - ref_loss) / abs(ref_loss), tol,
                  experts_implementation=experts, device=str(device()))
        if precision == "no":
            rec.check("MoE gradients vs plain model (fp32, relative to max)", _grad_diff(grads, ref_grads), tol,
                      experts_implementation=experts)
            continue
        ours, theirs = _grad_diff(grads, ref_grads), _grad_diff(_plain_bf16(sizes, batch), ref_grads)
        rec.check("MoE bf16 gradients' distance from fp32: engine / transformers' own bf16",
                  ours / max(theirs, 1e-12), MOE_BF16_RATIO, engine_bf16_vs_fp32=ours, transformers_bf16_vs_fp32=theirs,
                  experts_implementation=experts)


def ep_dispatch(rec: Recorder, sizes: Sizes) -> None:
    """Expert parallelism's token exchange on one device (an expert group of one rank: NCCL's all-to-all with
    itself, the host read of the split sizes, the experts' own implementation on the received rows) against the
    experts module's own forward: output and every gradient (experts', tokens', routing weights'), fp32 and bf16,
    and the time per call of each (the exchange's overhead on one device, where nothing needs to move)."""
    import time

    import torch.distributed as dist

    from ultrascale_plugins import init_distributed
    from ultrascale_plugins.dims.expert.dispatch import ExpertDispatch

    if not dist.is_initialized():
        init_distributed()  # the section's world of one: NCCL on the GPU, gloo in the dry run
    dev = device()
    model = _moe_model(sizes)
    experts = model.model.layers[0].mlp.experts.to(dev)
    k = model.config.num_experts_per_tok
    tokens, hidden = sizes.rows * sizes.seq, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:k] for _ in range(tokens)]).to(dev)
    weights = torch.rand(tokens, k, generator=g).to(dev)
    dispatch = ExpertDispatch(experts, experts.forward, experts.num_experts, dist.group.WORLD)
    for dtype, tol in ((torch.float32, TOL_FP32), (torch.bfloat16, TOL_BF16_REL)):
        experts.to(dtype)
        runs = {}
        for name, fn in (("own", experts.forward), ("exchange", dispatch)):
            experts.zero_grad(set_to_none=True)
            xi = x.detach().to(dtype).clone().requires_grad_()
            wi = weights.detach().to(dtype).clone().requires_grad_()
            out = fn(xi, index, wi)
            out.float().square().sum().backward()
            grads = {n: p.grad.float().clone() for n, p in experts.named_parameters()}
            runs[name] = (out.float(), xi.grad.float(), wi.grad.float(), grads)
        own, got = runs["own"], runs["exchange"]
        scale = own[0].abs().max().item() or 1.0
        diff = max([(a - b).abs().max().item() / max(b.abs().max().item(), 1e-12) for a, b in zip(got[:3], own[:3])]
                   + [(got[3][n] - own[3][n]).abs().max().item() / max(own[3][n].abs().max().item(), 1e-12)
                      for n in own[3]])
        label = "fp32" if dtype == torch.float32 else "bf16"
        rec.check(f"EP exchange vs the experts' own forward: output and gradients ({label}, relative to max)", diff,
                  tol, output_scale=scale, experts_implementation=getattr(model.config, "_experts_implementation", None),
                  device=str(dev))
    experts.to(torch.bfloat16)
    times = {}
    for name, fn in (("own", experts.forward), ("exchange", dispatch)):
        xi = x.to(torch.bfloat16)
        with torch.no_grad():
            for _ in range(3):
                fn(xi, index, weights.to(torch.bfloat16))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                fn(xi, index, weights.to(torch.bfloat16))
            if dev.type == "cuda":
                torch.cuda.synchronize()
        times[name] = (time.perf_counter() - start) / 10
    rec.add("EP exchange time per call vs the experts' own forward (bf16, one device)", "ok",
            own_ms=1e3 * times["own"], exchange_ms=1e3 * times["exchange"], ratio=times["exchange"] / times["own"],
            tokens=tokens, top_k=k)
    del model, experts
    free_memory()

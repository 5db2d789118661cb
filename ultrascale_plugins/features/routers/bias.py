"""Built-in plugin: DeepSeek-V3's auxiliary-loss-free load balancing (``router_bias_update``), which transformers
does not train: every router that selects its experts with a per-expert bias (``e_score_correction_bias``: DeepSeek-V3,
GLM-4.5 MoE, Ergo, ...) has that bias moved after each optimizer step by ``router_bias_update`` towards equal loads:
up for each expert that took fewer (token, expert) assignments than the mean, down for each that took more,
counted over the whole step (every micro-batch, every rank that holds other tokens). The counts are integers and
the update their sign, so the bias is the same in every layout, bit for bit.

Every routed token of the batch counts, padding excluded (a padded position's hidden state differs between
layouts: context parallel computes it otherwise); a recomputation (activation checkpointing) does not count twice,
and neither validation nor a pipeline's run on stand-in inputs (``ParallelContext.stand_in``) counts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...interface.config import field_error
from ...interface.hookspecs import hookimpl
from ...interface.stages import Stage

BIAS = "e_score_correction_bias"
STATE = "router_bias"


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("router_bias_update", float, 0.0, "auxiliary-loss-free load balancing (DeepSeek-V3): after each "
               "optimizer step, every router's e_score_correction_bias moves by this much towards equal expert "
               "loads, from the step's token counts over every rank; 0 = off (the bias stays as loaded)", minimum=0.0)


def routers(model) -> list[tuple[str, torch.nn.Module]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(getattr(m, BIAS, None), torch.Tensor)]


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if config.router_bias_update and not routers(model):
        arch = getattr(model.config, "model_type", type(model).__name__)
        raise field_error("router_bias_update", config.router_bias_update, f"model type '{arch}' has no router that "
                          f"selects experts with a per-expert bias ({BIAS})", "use router_bias_update: 0")


@hookimpl
def ultrascale_transform_stages(config, model_config):
    return [Stage("router_bias", count_routed_tokens, after=("float8",), before=("tp",),
                  active=bool(config.router_bias_update),
                  does="count each expert's routed tokens for the auxiliary-loss-free bias update")]


def count_routed_tokens(model, ctx):
    if not ctx.config.router_bias_update:
        return
    counts = ctx.plugin_state.setdefault(STATE, {})
    found = routers(model)
    if not found:
        return
    # the padding mask of the rows the base model runs now (a pipeline stage's micro-batch, a context-parallel
    # chunk), seen where the causal LM hands it to its base model
    lm = ctx.plan.causal_lm(model) if ctx.plan is not None else model
    base = getattr(lm, getattr(lm, "base_model_prefix", "") or "", None) or lm
    seen: dict = {}
    base.register_forward_pre_hook(_mask_of(seen), with_kwargs=True)
    for _, router in found:
        counts[router] = torch.zeros(getattr(router, BIAS).shape[0], dtype=torch.long, device=ctx.device)
        router.register_forward_hook(_counter(counts, seen, ctx))


def _mask_of(seen: dict):
    def hook(module, args, kwargs):
        seen["mask"] = kwargs.get("attention_mask")

    return hook


def _counter(counts, seen, ctx):
    def count(module, args, output):
        if not module.training or ctx.stand_in or torch._C._current_graph_task_id() != -1:
            return  # validation, stand-in inputs, or a recomputation
        chosen = next((t for t in (output if isinstance(output, tuple) else (output,))
                       if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2), None)
        if chosen is None:
            return
        mask = seen.get("mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() == chosen.shape[0]:
            chosen = chosen[mask.reshape(-1).bool()]  # padding left out
        counts[module] += torch.bincount(chosen.reshape(-1), minlength=counts[module].numel()).to(
            counts[module].device)

    return count


@hookimpl
def ultrascale_step_after_backward(pmodel):
    counts = pmodel.ctx.plugin_state.get(STATE)
    if not counts:
        return
    rate = pmodel.config.router_bias_update
    modules = list(counts)
    flat = torch.cat([counts[m] for m in modules])
    if pmodel.tokens.group is not None:  # every rank that routed other tokens of this step
        dist.all_reduce(flat, group=pmodel.tokens.group)
    for module, load in zip(modules, flat.split([counts[m].numel() for m in modules])):
        bias = getattr(module, BIAS)
        with torch.no_grad():
            bias += rate * torch.sign(load.float().mean() - load.float()).to(bias.dtype)
        counts[module].zero_()

"""Activation checkpointing of each decoder layer: ``full`` recomputes the whole layer in backward,
``selective`` keeps matmul and attention outputs and recomputes the cheap element-wise work.

The layer's ``forward`` is wrapped in place rather than wrapping the module (torch's checkpoint_wrapper), so
parameter names (FQNs) stay those of the unmodified model and checkpoints load across layouts.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ...interface.hookspecs import hookimpl
from ...interface.stages import Stage, step

MODES = ("none", "full", "selective")

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(module: torch.nn.Module, selective: bool) -> None:
    inner = module.forward
    context_fn = functools.partial(create_selective_checkpoint_contexts, _policy) if selective else None

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        if context_fn is None:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = forward


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("activation_checkpointing", str, "none", "recompute each decoder layer in backward: full, or "
               "selective (keep matmul and attention outputs)", choices=MODES,
               words=lambda mode: f"activation checkpointing={mode}")
    # the facts this plugin decides for the others (answered in ultrascale_declare_facts), with their defaults
    fields.fact("recompute", "none", "what the backward recomputes of the forward: none, selective or full")


@hookimpl
def ultrascale_declare_facts(config, degrees):
    return {"recompute": config.activation_checkpointing}


@hookimpl
def ultrascale_transform_stages(config, model_config):
    return [Stage("ac", wrap_layers, after=("cp",), active=config.activation_checkpointing != "none",
                  does=f"each decoder layer recomputes its activations in backward ({config.activation_checkpointing})")]


def wrap_layers(model, ctx):
    mode = ctx.config.activation_checkpointing
    if mode == "none":
        return
    for fqn in ctx.plan_layers(model):
        _wrap(model.get_submodule(fqn), selective=(mode == "selective"))


@hookimpl
@step("activations", after="split", before="ep")
def ultrascale_cost_estimate(config, model_config, shape, estimate):
    """The activations of the whole layers the pipeline left this rank, before expert and tensor parallel cut
    their weights (the recomputation's FLOPs ratio is the whole layer's)."""
    from .costs import activation_terms

    activation_terms(config, shape, estimate)

"""The mixture-of-experts router auxiliary (load-balancing) loss, exactly as one process computes it on the global
batch.

transformers adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k,
attention_mask)`` to the loss when ``output_router_logits`` is on. That function takes means over *all* tokens of
the batch (the fraction routed to each expert times its mean probability), so it does not split into per-rank
parts. Here every data-parallel rank gathers the router logits of the whole global batch (tokens x experts per
layer: small), the model's own function computes the global value, and only this rank's slice carries a
gradient, so the ranks' gradients add up to the single-process gradient.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ...interface.config import ConfigError


def aux_loss_function(model):
    """(function, num_experts, top_k, coefficient) of a model whose causal-LM head adds the auxiliary loss the
    transformers way; a ConfigError for one that does it another way."""
    # the model's own class (FSDP wraps it in a subclass defined elsewhere)
    fn = next((getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None) for cls in type(model).__mro__
               if getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None) is not None), None)
    names = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    if fn is None or not all(hasattr(model, n) for n in names):
        raise ConfigError(
            f"output_router_logits=True: model type '{getattr(model.config, 'model_type', '?')}' computes its router "
            "auxiliary loss in a way this version does not reproduce across ranks. Fix: set "
            "output_router_logits=False in the model config")
    return fn, model.num_experts, model.num_experts_per_tok, float(model.router_aux_loss_coef)


def _gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """Rows of every rank of ``group`` in rank order; only this rank's rows keep their gradient."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    parts[dist.get_rank(group)] = local
    return torch.cat(parts)


def router_aux_loss(model, router_logits, attention_mask, dp_group, shape=None) -> torch.Tensor:
    """``coef * aux`` over the global batch (same value on every rank; gradient for this rank's tokens).
    ``shape``: this rank's (rows, tokens per row). Ranks whose batches differ in shape (a collator padding each
    rank's rows to their own longest) are padded to the largest, the padding masked out, so the value is the one
    of every rank's real tokens."""
    fn, num_experts, top_k, coef = aux_loss_function(model)
    logits = tuple(router_logits)
    if dp_group is not None:
        if shape is not None:
            logits, attention_mask = _padded(logits, attention_mask, shape, dp_group)
        logits = tuple(_gather_rows(layer, dp_group) for layer in logits)
        if attention_mask is not None:
            attention_mask = _gather_rows(attention_mask, dp_group)
    return coef * fn(logits, num_experts, top_k, attention_mask)


def _padded(logits: tuple, mask, shape, group):
    """Each layer's router logits (rows x tokens, experts) and the padding mask padded to the largest rows and
    tokens of any rank of ``group`` (one small all-gather of the shapes); unchanged when every rank's shape is
    the same. Without a mask, one is made: every real token counts, as the model counts them without a mask."""
    rows, seq = shape
    sizes = torch.tensor([rows, seq], dtype=torch.long, device=logits[0].device)
    every = [torch.empty_like(sizes) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, sizes, group=group)
    most_rows, most_seq = (int(x) for x in torch.stack(every).max(0).values)
    if all(int(s[0]) == rows and int(s[1]) == seq for s in every):
        return logits, mask
    pad = torch.nn.functional.pad
    if mask is None:
        mask = torch.ones(rows, seq, dtype=torch.long, device=logits[0].device)
    mask = pad(mask, (0, most_seq - seq, 0, most_rows - rows), value=0)
    logits = tuple(pad(layer.reshape(rows, seq, -1), (0, 0, 0, most_seq - seq, 0, most_rows - rows))
                   .reshape(most_rows * most_seq, -1) for layer in logits)
    return logits, mask

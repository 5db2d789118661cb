"""Causal-LM loss as the global mean over valid tokens, whatever the layout.

Each rank sums its token losses; the sum is divided by the number of valid tokens in the whole global batch
(all data-parallel ranks), so ranks holding different numbers of padded tokens still produce exactly the
single-process loss and gradients. Labels follow transformers: shifted by one, -100 ignored.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shifted_targets(batch: dict) -> torch.Tensor:
    """Next-token targets: ``labels`` (or ``input_ids`` with padding masked) shifted left by one."""
    labels = batch.get("labels")
    if labels is None:
        labels = batch["input_ids"]
        mask = batch.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def valid_token_counts(chunks: list[dict]) -> torch.Tensor:
    """Valid target tokens of each micro-batch (labels shifted as the loss shifts them), float64."""
    return torch.tensor([float((shifted_targets(c) != IGNORE_INDEX).sum()) for c in chunks], dtype=torch.float64)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over valid tokens, in fp32. Works on vocab-sharded DTensor logits inside
    ``torch.distributed.tensor.parallel.loss_parallel()``."""
    logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@dataclasses.dataclass
class TokenOutputs:
    """Per-token figures of one micro-batch on this rank, each shaped like its next-token targets (this rank's
    part of them, or its rows whole: ``pmodel.outputs.token_outputs(whole_rows=True)``) and zero where the target is
    ignored: the log-probability of the target (with gradient), the entropy of the prediction, whether the target
    is its top-1 and the mean of the logits (without). ``label_mask``: the valid targets; ``count``: the valid
    targets of the global micro-batch (every rank holding other tokens); ``output``: the model's output;
    ``terms``: the objective's other terms for this micro-batch (``ultrascale_step_loss``'s ``terms``: a mixture of
    experts' router auxiliary loss over the global batch, with its coefficient), to fold in with
    ``pmodel.tokens.add_terms``."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    is_top1: torch.Tensor
    label_mask: torch.Tensor
    mean_logits: torch.Tensor | None = None  # the mean of each token's logits over the vocabulary (no gradient)
    count: torch.Tensor | None = None
    output: Any = None
    terms: list = dataclasses.field(default_factory=list)  # the plugins' extra loss terms (a router's auxiliary loss)

    @property
    def aux_loss(self):
        return getattr(self.output, "aux_loss", None)


def token_outputs_of(logits: torch.Tensor, targets: torch.Tensor) -> TokenOutputs:
    """``TokenOutputs`` from the whole logits (a vocabulary-sharded DTensor is gathered first)."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    valid = targets != IGNORE_INDEX
    log_probs = logits.float().log_softmax(-1)
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1) * valid
        top1 = (logits.argmax(-1) == targets) & valid
        mean = logits.float().mean(-1) * valid
    return TokenOutputs(picked, entropy, top1, valid, mean_logits=mean)

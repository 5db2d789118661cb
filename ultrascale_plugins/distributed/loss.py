"""Causal-LM loss as the global mean over valid tokens, whatever the layout.

Each rank sums its token losses; the sum is divided by the number of valid tokens in the whole global batch
(all data-parallel ranks), so ranks holding different numbers of padded tokens still produce exactly the
single-process loss and gradients. Labels follow transformers: shifted by one, -100 ignored.
"""
from __future__ import annotations

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

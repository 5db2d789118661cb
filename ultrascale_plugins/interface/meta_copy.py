"""A structural copy of a model on the meta device: the same module tree, classes, names and ties, no storage.

Used where the architecture must be run or inspected without touching the real weights (the data-flow and
dry-run checks, the shard-by-shard initialization). Unlike rebuilding ``type(model)(config)``, it copies any
wrapper around a causal LM (a PEFT model: its adapters are part of the tree) and whatever the user changed
after construction.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def meta_copy(model: nn.Module, meta_buffers: bool = False) -> nn.Module:
    """``model``'s module tree with every parameter (and, with ``meta_buffers``, every buffer) on the meta device;
    tied parameters stay tied. Other buffers are copied (they are small). Parameters become plain
    ``nn.Parameter``s of their global shape."""
    memo: dict[int, object] = {}
    for p in model.parameters():  # a parameter already distributed (a DTensor) is copied at its global shape
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
    if meta_buffers:
        for b in model.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)

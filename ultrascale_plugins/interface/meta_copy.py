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
    ``nn.Parameter``s of their global shape. Module hooks are not copied: a hook the user registered (recording
    outputs, say) must not run, or be handed meta tensors, when the engine runs the copy."""
    memo: dict[int, object] = {}
    for p in model.parameters():  # a parameter already distributed (a DTensor) is copied at its global shape
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
    if meta_buffers:
        for b in model.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
    for module in model.modules():  # the copy runs dry runs: none of the user's hooks (nor what they hold) come
        for name in _HOOKS:
            hooks = getattr(module, name, None)
            if isinstance(hooks, dict):
                memo[id(hooks)] = type(hooks)()
    return copy.deepcopy(model, memo)


_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")

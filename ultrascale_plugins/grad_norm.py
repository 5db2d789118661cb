"""Gradient-norm clipping over a mix of plain, TP-sharded and FSDP-sharded (DTensor) gradients.

torch's ``clip_grad_norm_`` cannot stack DTensors that live on different meshes with plain tensors, so the
norm is computed per group of identical placement and the groups are combined.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for key, group in groups.items():
        n = torch.nn.utils.get_total_norm(group, norm_type=norm_type)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float())
    if not norms:
        return torch.tensor(0.0)
    stacked = torch.stack(norms)
    total = stacked.max() if norm_type == float("inf") else stacked.norm(norm_type)
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        for group in groups.values():  # one foreach call per placement group: foreach cannot mix them
            torch._foreach_mul_(group, coef)
    return total

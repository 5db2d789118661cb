"""Gradient-norm clipping over a mix of plain, TP-sharded and FSDP-sharded (DTensor) gradients.

torch's ``clip_grad_norm_`` cannot stack DTensors that live on different meshes with plain tensors, so the
norm is computed per group of identical placement and the groups are combined.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, group=None, clip=None) -> torch.Tensor:
    """Norm over ``parameters`` (combined over ``group``, e.g. pipeline stages); scales the gradients of
    ``clip`` (default: the same parameters)."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    # the mesh's device: gradients held on the host (cpu_offload) reduce their norms there, as NCCL needs
    device = next((g.device_mesh.device_type for g in grads if isinstance(g, DTensor)), None)
    norms = []
    for same_placement in groups.values():
        n = torch.nn.utils.get_total_norm(same_placement, norm_type=norm_type)
        if isinstance(n, DTensor):
            local = n.to_local()
            if local.device.type != n.device_mesh.device_type:
                n = DTensor.from_local(local.to(n.device_mesh.device_type), n.device_mesh, n.placements,
                                       run_check=False)
            n = n.full_tensor()
        norms.append(n.float() if device is None else n.float().to(device))
    stacked = torch.stack(norms) if norms else torch.zeros(1)
    inf = norm_type == float("inf")
    total = stacked.max() if inf else stacked.norm(norm_type)
    if group is not None:
        import torch.distributed as dist

        part = total.double() if inf else total.double() ** norm_type
        dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        total = (part if inf else part ** (1.0 / norm_type)).float()
    # the coefficient stays a tensor, never read on the host (no device sync; a dry run's fake tensors have no
    # value), clamped at 1 and always applied, as torch's clip_grads_with_norm_ does: multiplying by 1.0 is exact
    coef = (float(max_norm) / (total.double() + 1e-6)).clamp(max=1.0).float()
    targets: dict = {}
    for p in (clip if clip is not None else parameters):
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            targets.setdefault(key, []).append(g)
    for same in targets.values():  # one foreach call per placement group: foreach cannot mix them
        local = same[0].to_local() if isinstance(same[0], DTensor) else same[0]
        torch._foreach_mul_(same, coef.to(local.device))
    return total

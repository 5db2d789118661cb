"""The gradient averaging the engine does itself, reached as ``pmodel.gradients``: over the layout's gradient axes
no wrapper claimed (FSDP and DDP average theirs inside the backward, ``ParallelContext.claim_grad_reduction``), and
for the modules a plan puts in a mesh view, over the view's unclaimed axes with what is left of the loss scale.
``ParallelModel.finish_backward`` runs it after a backward that completes the gradients."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class GradientReductions:
    """(parameters, process group or None, divisor) per group of parameters whose gradients the engine still
    reduces. ``consumed``: why the gradients are gone once the backward ends (a plugin that steps the optimizer
    inside it sets it), so that clipping to a global norm is refused, not computed over nothing."""

    def __init__(self, ctx, parameters):
        self.ctx = ctx
        self.dims = ctx.dims
        self.groups = self._groups(parameters)
        self.consumed = ""

    def _groups(self, parameters) -> list[tuple[list, Any, float]]:
        """The layout's gradient axes no wrapper claimed (an average), and for each mesh view the plan puts
        modules in, the view's unclaimed gradient axes (a sum) and what is left of the loss scale."""
        ctx, dims = self.ctx, self.dims
        in_view: dict[int, str] = {}
        for part in ctx.modules:
            for fqn, view in ctx.view_modules(part).items():
                for param in part.get_submodule(fqn).parameters():
                    in_view[id(param)] = view
        groups: dict[str | None, list] = {}
        for param in parameters:
            groups.setdefault(in_view.get(id(param)), []).append(param)
        out = []
        for view, params in groups.items():
            if view is None:
                mesh = dims.sub_mesh(tuple(a for a in dims.grad_axes if a not in ctx.claimed_axes))
                if mesh is not None:
                    out.append((params, mesh.get_group(), float(mesh.size())))
                continue
            claimed, applied = ctx.view_claims.get(view, (set(), 1.0))
            rest = tuple(a for a in dims.view_grad_axes(view) if a not in claimed)
            mesh = dims.sub_mesh(tuple(a for a in rest if dims.degree(a) > 1), view=view)
            divisor = dims.grad_scale / applied
            if mesh is not None or divisor != 1:
                out.append((params, mesh.get_group() if mesh is not None else None, divisor))
        return out

    @property
    def unclaimed_axes(self) -> list[str]:
        """The gradient axes whose averaging the engine does after the backward (no wrapper reduced them inside
        it), a mesh view's as ``view:axis``; empty when every gradient is final when its backward ends."""
        if not self.groups:
            return []
        ctx, dims = self.ctx, self.dims
        out = [a for a in dims.grad_axes if a not in ctx.claimed_axes]
        for view in dims.views:
            claimed, _ = ctx.view_claims.get(view, (set(), 1.0))
            out += [f"{view}:{a}" for a in dims.view_grad_axes(view) if a not in claimed and dims.degree(a) > 1]
        return out or ["the loss scale's division"]

    def average(self) -> None:
        """Reduce every group's gradients (after a backward that completes them)."""
        for params, group, divisor in self.groups:
            average_gradients(params, group, divisor)


def average_gradients(params, group, size: float) -> None:
    """Sum the (local shards of the) gradients over ``group`` (None: this rank's alone) in one flat all-reduce and
    divide them by ``size`` (the group's size: an average)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in local:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()

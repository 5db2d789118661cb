"""A module run on the local values of its DTensor parameters, the tensor-parallel building blocks torch lacks:
Megatron's "f" and "g" (``all_reduce_backward``, ``all_reduce_forward``) and a replicated parameter whose gradient
is summed over the mesh (``LocalWithSummedGrad``, ``run_on_local_params``). The tensor family's styles and the
architectures' own (``models/gpt2``, ``models/delta_net_heads``) build on them."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate


def all_reduce_backward(x: torch.Tensor, mesh) -> torch.Tensor:
    """Identity forward, gradient summed over TP in backward (Megatron's "f"): for a replicated input that
    each rank uses with its own shard of the weights."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def all_reduce_forward(x: torch.Tensor, mesh) -> torch.Tensor:
    """Sum of the ranks' partial results in forward, gradient passed through (Megatron's "g")."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class LocalWithSummedGrad(torch.autograd.Function):
    """A replicated DTensor parameter seen as its local tensor; the gradient each rank computes from its own
    data is summed over the mesh and handed back as a replicated DTensor. (``DTensor.to_local`` with a Partial
    gradient placement leaves the parameter's gradient Partial, which neither the optimizer nor FSDP reduce.)"""

    @staticmethod
    def forward(ctx, param):
        ctx.mesh, ctx.placements = param.device_mesh, param.placements
        local = param.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.mesh.get_group())
        return DTensor.from_local(grad, ctx.mesh, ctx.placements, run_check=False)


def run_on_local_params(module: nn.Module, mesh, replicate_plain: bool, only: set[str] | None = None) -> None:
    """Run ``module``'s forward on the local values of its own parameters.

    With ``replicate_plain``, plain parameters first become replicated DTensors on ``mesh`` whose gradient is
    summed over the mesh: the one rule for a parameter that every TP rank holds whole but applies to different
    data — this rank's heads (Qwen3's per-head ``q_norm``), this rank's sequence shard (every norm under sequence
    parallel), a gate multiplying partial expert outputs. As DTensors they compose with FSDP2's sharding over
    data parallel (a gradient hook on the original tensor would be lost when FSDP swaps the parameters).
    Already sharded parameters (e.g. attention sinks split by heads) are used as their local shard. ``only``
    limits the replicated ones to those names."""
    if replicate_plain:
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor) and (only is None or name in only):
                module.register_parameter(name, nn.Parameter(
                    DTensor.from_local(param, mesh, [Replicate()], run_check=False),
                    requires_grad=param.requires_grad))
    if getattr(module, "_ultrascale_local_params", False):
        return
    inner = module.forward

    def forward(*args, **kwargs):
        saved = dict(module._parameters)
        try:
            for name, param in saved.items():
                if isinstance(param, DTensor):
                    summed = all(isinstance(p, Replicate) for p in param.placements)
                    module._parameters[name] = (LocalWithSummedGrad.apply(param) if summed and param.requires_grad
                                                else param.to_local())
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward
    module._ultrascale_local_params = True

"""transformers' TP style names mapped onto torch DTensor parallel styles.

transformers' own ``apply_tensor_parallelism`` always spans the whole world (it ignores a 2-D ``dp x tp`` mesh),
so this package applies torch's styles on the ``tp`` sub-mesh itself. The two styles torch lacks — a fused
("packed") column-parallel Conv1D weight and a replicated weight whose gradient is summed over TP — are
written here.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import _StridedShard

from ..config import ConfigError


class PackedColwiseParallel(ParallelStyle):
    """Column-parallel for a weight that packs ``split_factor`` projections side by side (e.g. q|k|v), with the
    output dimension as dim 1 (GPT-2's Conv1D weight is ``[in, out]``).

    Each rank keeps its slice of every packed part (placement ``_StridedShard``), so its local output is
    ``[q_i | k_i | v_i]`` and ``full_tensor()`` still returns the original layout. The matmul runs on local
    tensors; the input is marked so that its gradient is all-reduced over TP (Megatron's "f" operator).
    The bias stays replicated over TP and each rank slices its part in forward (the slice's backward gathers
    the gradient): a strided TP shard on dim 0 would share that dim with FSDP's shard, and torch mis-places
    the gradient of such nested strided shards.
    """

    def __init__(self, split_factor: int):
        super().__init__()
        self.split_factor = split_factor

    def _partition(self, name, module, mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = _StridedShard(1, split_factor=self.split_factor) if param.ndim > 1 else Replicate()
            dparam = distribute_tensor(param, mesh, [placement])
            module.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        bias_slice = [_StridedShard(0, split_factor=self.split_factor)]

        def local_forward(x):
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
            w = module.weight.to_local()
            y = x.reshape(-1, x.shape[-1]) @ w
            if module.bias is not None:
                y = y + module.bias.redistribute(device_mesh, bias_slice).to_local()
            return y.view(*x.shape[:-1], w.shape[1])

        distribute_module(module, device_mesh, self._partition)
        module.forward = local_forward  # instance attribute: hooks on the module still run around it
        return module


class ReplicatedWithGradAllReduce(ParallelStyle):
    """Parameters stay replicated plain tensors; their gradients are summed over TP ranks (for weights that
    see different data on each TP rank, e.g. a router or a norm fed sequence shards)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        group = device_mesh.get_group()

        def reduce(grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            return grad

        for param in module.parameters(recurse=False):
            if param.requires_grad:
                param.register_hook(reduce)
        return module


def make_style(name: str, *, sequence_parallel: bool, loss_parallel: bool, is_head: bool,
               extra: dict[str, Callable] | None = None) -> ParallelStyle:
    """Build the torch ParallelStyle for a transformers style name, adjusted for sequence/loss parallel."""
    if extra and name in extra:
        return extra[name](sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    seq = Shard(1)
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())
    if name == "colwise_gather_output" or (name == "colwise_rep" and is_head):
        input_layout = seq if sequence_parallel else Replicate()
        if loss_parallel and is_head:
            return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(input_layouts=input_layout, output_layouts=Replicate())
    if name == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate())
    if name in ("embedding_rowwise", "vocab_parallel_embedding"):
        # Output replicated even under SP: the first decoder layer splits the sequence (see dims.tensor),
        # so the model still builds its masks and positions on the full sequence.
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name in ("replicated_with_grad_allreduce", "replicate"):
        return ReplicatedWithGradAllReduce()
    if name == "sequence_parallel":
        return SequenceParallel()
    known = ["colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise",
             "replicated_with_grad_allreduce", "sequence_parallel", *sorted(extra or {})]
    raise ConfigError(f"tp plan style '{name}' is not supported. Fix: use one of {', '.join(known)}, or register a "
                      "plugin whose ultrascale_model_plan supplies a style of that name")


def redistribute_first_input(mesh, src, dst) -> Callable:
    """A forward pre-hook that moves the module's first input (positional, or ``hidden_states=``) from
    placement ``src`` to ``dst`` and hands the module a local tensor. Written here because torch's
    PrepareModuleInput must be told whether an input arrives positionally or by keyword, and Hugging Face
    calls decoder layers positionally but attention modules by keyword."""

    def convert(x):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [src], run_check=False)
        if tuple(x.placements) != (dst,):
            x = x.redistribute(placements=[dst])
        return x.to_local()

    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (convert(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}
        return args, kwargs

    return hook


def redistribute_output(mesh, src, dst) -> Callable:
    """A forward hook that moves a module's (local tensor) output from placement ``src`` to ``dst``."""

    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            return output
        x = output if isinstance(output, DTensor) else DTensor.from_local(output, mesh, [src], run_check=False)
        return x.redistribute(placements=[dst]).to_local()

    return hook

"""Built-in plugin: GPT-2, which has no TP plan in transformers and uses ``Conv1D`` (a Linear with a transposed
weight, ``[in, out]``) with query, key and value fused in one ``c_attn``.

Column-parallel Conv1D shards the weight's dim 1, row-parallel shards dim 0; ``c_attn`` is packed-column
parallel (each rank keeps its heads' slice of q, k and v), and each attention module then splits its local
output into ``embed_dim / tp`` wide parts.
"""
from __future__ import annotations

import torch
from torch import nn
from functools import partial

from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from ..interface.hookspecs import hookimpl
from ..interface.stages import Stage
from ..distributed.local_params import all_reduce_backward, run_on_local_params
from .plan import hf_plan_from_model


class PackedColwiseParallel(ParallelStyle):
    """Column-parallel for a weight that packs ``split_factor`` projections side by side (e.g. q|k|v), with the
    output dimension as dim 1 (GPT-2's Conv1D weight is ``[in, out]``).

    Each rank keeps its slice of every packed part (placement ``_StridedShard``), so its local output is
    ``[q_i | k_i | v_i]`` and ``full_tensor()`` still returns the original layout. The matmul runs on local
    tensors; the input is marked so that its gradient is all-reduced over TP (Megatron's "f" operator), unless
    ``partial_input``: then its region reduces the summed gradient of all its projections once (see
    ``region_input``). The bias stays replicated over TP and each rank slices its part in forward (the slice's backward gathers
    the gradient): a strided TP shard on dim 0 would share that dim with FSDP's shard, and torch mis-places
    the gradient of such nested strided shards.
    """

    def __init__(self, split_factor: int, partial_input: bool = False):
        super().__init__()
        self.split_factor, self.partial_input = split_factor, partial_input

    def _partition(self, name, module, mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = _StridedShard(1, split_factor=self.split_factor) if param.ndim > 1 else Replicate()
            dparam = distribute_tensor(param, mesh, [placement])
            module.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        bias_slice = [_StridedShard(0, split_factor=self.split_factor)]

        def local_forward(x):
            if not self.partial_input:
                x = all_reduce_backward(x, device_mesh)
            w = module.weight.to_local()
            y = x.reshape(-1, x.shape[-1]) @ w
            if module.bias is not None:
                y = y + module.bias.redistribute(device_mesh, bias_slice).to_local()
            return y.view(*x.shape[:-1], w.shape[1])

        distribute_module(module, device_mesh, self._partition)
        module.forward = local_forward  # instance attribute: hooks on the module still run around it
        return module


def _conv1d_apply(style, module, mesh, weight_dim: int, bias_placement):
    """Apply a torch Colwise/Rowwise style to a Conv1D: same input/output handling, transposed weight."""

    def partition(_name, mod, mesh_):
        for pname, param in list(mod.named_parameters(recurse=False)):
            placement = Shard(weight_dim) if param.ndim > 1 else bias_placement
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh_, [placement]),
                                                       requires_grad=param.requires_grad))

    return distribute_module(
        module, mesh, partition,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output))


class Conv1DColwise(ColwiseParallel):
    def _apply(self, module, device_mesh):
        return _conv1d_apply(self, module, device_mesh, weight_dim=1, bias_placement=Shard(0))


class Conv1DLocalColwise(ParallelStyle):
    """Column-parallel Conv1D that leaves its input's gradient partial (its region reduces it once: see
    ``dims.tensor.styles.LocalColwise``): this rank's columns of the weight and bias applied to the plain input."""

    def _apply(self, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(1) if param.ndim > 1 else Shard(0)
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                          requires_grad=param.requires_grad))

        def forward(x):
            y = torch.addmm(module.bias, x.reshape(-1, x.shape[-1]), module.weight)
            return y.view(*x.shape[:-1], y.shape[-1])

        module.forward = forward
        run_on_local_params(module, device_mesh, replicate_plain=False)  # wraps the forward above
        return module


class Conv1DRowwise(RowwiseParallel):
    def _apply(self, module, device_mesh):
        self.desired_input_layouts = (Shard(-1),)
        return _conv1d_apply(self, module, device_mesh, weight_dim=0, bias_placement=Replicate())


def _style(make, partial=None):
    """A style factory; ``partial``: its variant that leaves the input's gradient partial (``make_style``)."""
    def factory(sequence_parallel, loss_parallel):
        return make(sequence_parallel)

    if partial is not None:
        factory.partial_input = lambda sequence_parallel, loss_parallel: partial()
    return factory


STYLES = {
    "conv1d_colwise": _style(lambda sp: Conv1DColwise(), Conv1DLocalColwise),
    "conv1d_rowwise": lambda sequence_parallel, loss_parallel: Conv1DRowwise(
        output_layouts=Shard(1) if sequence_parallel else Replicate()),
    "conv1d_packed_colwise": _style(lambda sp: PackedColwiseParallel(split_factor=3),
                                    lambda: PackedColwiseParallel(split_factor=3, partial_input=True)),
}

TP_PLAN = {
    "transformer.wte": "embedding_rowwise",
    "transformer.h.*.attn.c_attn": "conv1d_packed_colwise",
    "transformer.h.*.attn.c_proj": "conv1d_rowwise",
    "transformer.h.*.mlp.c_fc": "conv1d_colwise",
    "transformer.h.*.mlp.c_proj": "conv1d_rowwise",
    "lm_head": "colwise_gather_output",
}


def _is_gpt2(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "gpt2" and hasattr(model, "transformer")


@hookimpl
def ultrascale_declare_model_plan(model, config):
    if not _is_gpt2(model):
        return None
    plan = hf_plan_from_model(model, dict(TP_PLAN))
    plan.styles = dict(STYLES)
    return plan


@hookimpl
def ultrascale_transform_stages(config, model_config):
    gpt2 = getattr(model_config, "model_type", None) == "gpt2"
    return [Stage("gpt2_heads", split_this_ranks_heads, after=("float8",), before=("tp",), axes=("tp",),
                  active=config.tp > 1 and gpt2, does="GPT-2's attention splits its fused q|k|v by this rank's heads")]


def split_this_ranks_heads(model, ctx):
    if ctx.config.tp == 1 or not _is_gpt2(model):
        return
    for block in model.transformer.h:
        block.attn.split_size = block.attn.embed_dim // ctx.config.tp

"""Built-in plugin: GPT-2, which has no TP plan in transformers and uses ``Conv1D`` (a Linear with a transposed
weight, ``[in, out]``) with query, key and value fused in one ``c_attn``.

Column-parallel Conv1D shards the weight's dim 1, row-parallel shards dim 0; ``c_attn`` is packed-column
parallel (each rank keeps its heads' slice of q, k and v), and each attention module then splits its local
output into ``embed_dim / tp`` wide parts.
"""
from __future__ import annotations

from torch import nn
from functools import partial

from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..interface.hookspecs import hookimpl
from ..dims.tp_styles import PackedColwiseParallel
from .plan import hf_plan_from_model


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


class Conv1DRowwise(RowwiseParallel):
    def _apply(self, module, device_mesh):
        self.desired_input_layouts = (Shard(-1),)
        return _conv1d_apply(self, module, device_mesh, weight_dim=0, bias_placement=Replicate())


STYLES = {
    "conv1d_colwise": lambda sequence_parallel, loss_parallel: Conv1DColwise(),
    "conv1d_rowwise": lambda sequence_parallel, loss_parallel: Conv1DRowwise(
        output_layouts=Shard(1) if sequence_parallel else Replicate()),
    "conv1d_packed_colwise": lambda sequence_parallel, loss_parallel: PackedColwiseParallel(split_factor=3),
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
def ultrascale_model_plan(model, config):
    if not _is_gpt2(model):
        return None
    plan = hf_plan_from_model(model, dict(TP_PLAN))
    plan.styles = dict(STYLES)
    return plan


@hookimpl
def ultrascale_shard_model(model, ctx):
    if ctx.config.tp == 1 or not _is_gpt2(model):
        return
    for block in model.transformer.h:
        block.attn.split_size = block.attn.embed_dim // ctx.config.tp

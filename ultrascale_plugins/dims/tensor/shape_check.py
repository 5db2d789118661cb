"""Run the model once on the meta device with every parameter the TP plan shards cut to one rank's shape.

A plan can name styles whose local shapes the model's own code does not expect: Doge's plan makes ``dt_proj``
row-parallel, so it returns every KV head while the attention around it holds only this rank's, and the step
crashes on the first batch inside the workers. Shapes alone decide this, so a meta-device run with the local
shapes finds it before any worker starts, for any architecture, at no memory cost.

Only layouts whose local shapes are certain are simulated: column-parallel layers lose output features,
row-parallel ones input features, parameters the plan names directly lose what their placement shards. Styles
that gather or reduce their output keep the full shape. A plan with a style or module this cannot size is not
checked (the trace in ``models.dataflow`` still runs).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate

from .styles import param_placement

_FULL_OUTPUT = {"colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep", "embedding_rowwise",
                "vocab_parallel_embedding", "embedding_colwise", "replicated_with_grad_allreduce", "local_params",
                "replicate", "moe_tp_experts", "moe_identity_expert", "all_reduce", "mla_kv_a_proj",
                "sequence_parallel"}


def _cut(module: nn.Module, name: str, dim: int, tp: int) -> bool:
    param = getattr(module, name)
    if param is None:
        return True
    if param.shape[dim] % tp:
        return False
    module.register_parameter(name, nn.Parameter(param.narrow(dim, 0, param.shape[dim] // tp)))
    return True


def local_shapes_twin(model: nn.Module, plan, tp: int) -> nn.Module | None:
    """A meta twin with one rank's parameter shapes, or None when the plan holds something not sized here."""
    from ...models.dataflow import meta_twin

    twin = meta_twin(model)
    for fqn, style in plan.param_matches(twin).items():
        owner, _, name = fqn.rpartition(".")
        param = getattr(twin.get_submodule(owner), name)
        placement = param_placement(style, param.ndim)
        if placement is None:
            return None
        if not isinstance(placement, Replicate) and not _cut(twin.get_submodule(owner), name, placement.dim, tp):
            return None
    for fqn, style in plan.matches(twin).items():
        module = twin.get_submodule(fqn)
        if fqn == plan.lm_head or style in _FULL_OUTPUT or fqn in plan.param_matches(twin):
            continue
        if not isinstance(module, nn.Linear) or style not in ("colwise", "packed_colwise", "unit_colwise", "rowwise",
                                                              "unit_rowwise"):
            return None
        if "rowwise" in style:
            ok = _cut(module, "weight", 1, tp)
        else:
            ok = _cut(module, "weight", 0, tp) and _cut(module, "bias", 0, tp)
        if not ok:
            return None
    return twin


def shape_check(model: nn.Module, plan, tp: int) -> None:
    """Raise what the model raises when run with one rank's shapes (nothing when it cannot be sized)."""
    from ...models.dataflow import meta_inputs

    twin = local_shapes_twin(model, plan, tp)
    if twin is None:
        return
    with torch.no_grad():
        twin(**meta_inputs(8))

"""Tensor parallel's part of a layout's cost: each parameter the plan shards cut to this TP rank's slice, and the
activation collectives of every layer (Korthikanti et al. 2022: two all-reduces forward and two backward per
layer; with sequence parallel each becomes an all-gather plus a reduce-scatter of the same volume)."""
from __future__ import annotations

from ..interface.estimates import chunk_size
from .tp_styles import param_placement

# The dims the weight and the bias of a module are sharded on, by style name (transformers' and this package's;
# GPT-2's Conv1D holds its weight transposed). Every other style keeps its parameters whole.
_MODULE_DIMS = {
    "colwise": (0, 0), "unit_colwise": (0, 0), "colwise_gather_output": (0, 0), "colwise_rep": (0, 0),
    "packed_colwise": (0, 0),
    "rowwise": (1, None), "unit_rowwise": (1, None), "rowwise_split_input": (1, None), "rowwise_rep": (1, None),
    "embedding_rowwise": (0, None), "vocab_parallel_embedding": (0, None), "embedding_colwise": (1, None),
    "conv1d_colwise": (1, 0), "conv1d_rowwise": (0, None), "conv1d_packed_colwise": (1, None),
}
_DIMS_CACHE: dict = {}
# A LoRA factor of a linear layer follows its base's style: B (out, r) is cut on its output features after a
# column-parallel base (weight dim 0), A (r, in) on its input features before a row-parallel one (weight dim 1); the
# other factor stays whole. (Adapters merged into their weight, and those of other layers, stay whole.)
_FOLLOWS = {"lora_B": {0: 0}, "lora_A": {1: 1}}


def sharded_dims(model, plan) -> dict:
    """{parameter FQN: the dim TP shards} for the plan's sharded parameters (styles not known here: left whole)."""
    key = (id(model), tuple(sorted(plan.tp_plan.items())))
    if key in _DIMS_CACHE and _DIMS_CACHE[key][0] is model:
        return _DIMS_CACHE[key][1]
    by_module, by_param = plan.matches(model), plan.param_matches(model)
    out = {}
    for name, param in model.named_parameters():
        if name in by_param:
            out[name] = getattr(param_placement(by_param[name], param.ndim), "dim", None)
            continue
        owner, _, leaf = name.rpartition(".")
        if by_module.get(owner) in _MODULE_DIMS:
            weight, bias = _MODULE_DIMS[by_module[owner]]
            out[name] = weight if leaf == "weight" else bias
    _DIMS_CACHE[key] = (model, out)
    return out


def tensor_parallel_terms(config, shape, est) -> None:
    tp = config.tp
    if tp == 1 or shape.plan is None:
        return
    rank = shape.coords.get("tp", 0)
    dims = sharded_dims(shape.model, shape.plan)
    for r in shape.inventory:
        dim = dims.get(r.name.removesuffix(" (head copy)"))
        if dim is None and r.adapter in _FOLLOWS and not r.merged:
            dim = _FOLLOWS[r.adapter].get(dims.get(r.adapter_of))
        if dim is None:  # whole on every TP rank (a plugin's own style, unknown here, is counted whole too)
            continue
        local = list(r.local)
        local[dim] = chunk_size(local[dim], tp, rank)
        r.local = tuple(local)
    act = shape.tokens_per_micro_batch * shape.model_config.hidden_size * shape.activation_bytes(config)
    layers = len({r.layer for r in shape.inventory if r.layer is not None})
    volume = 4 * act * layers  # per micro-batch: nothing to overlap these with
    if config.sequence_parallel:
        est.add_comm("tp", volume / 2, "all_gather", calls=4 * layers, per="micro_batch")
        est.add_comm("tp", volume / 2, "reduce_scatter", calls=4 * layers, per="micro_batch")
    else:
        est.add_comm("tp", volume, "all_reduce", calls=4 * layers, per="micro_batch")

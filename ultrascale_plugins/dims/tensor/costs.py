"""Tensor parallel's part of a layout's cost: each parameter the plan shards cut to this TP rank's slice, and the
activation collectives of every layer as the package runs them.

Megatron's count (Korthikanti et al. 2022) is one reduction of each region's input gradient and one of its
output, forward and backward: two all-reduces forward and two backward per layer, or under sequence parallel an
all-gather plus a reduce-scatter for each. The package reaches it where the model's data flow allows
(``models.dataflow``: the regions that reduce once, the sums, the ends); elsewhere each projection reduces on its
own, and the estimate counts what runs, region by region, from the same trace the workers use."""
from __future__ import annotations

from ...interface.estimates import chunk_size
from ...interface.facts import layout_facts
from .styles import param_placement

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
    tokens = shape.tokens_per_micro_batch
    act = tokens * _hidden(shape.model_config) * shape.activation_bytes(config)
    layers = len({r.layer for r in shape.inventory if r.layer is not None})
    holds_pre = any(r.part == "pre" for r in shape.inventory)
    counts = activation_collectives(shape.model, shape.plan, config.sequence_parallel, holds_pre,
                                    shape.holds_head, layers)
    for op, calls in counts.items():  # per micro-batch: nothing to overlap these with
        if calls:
            est.add_comm("tp", calls * act, op, calls=calls, per="micro_batch")
    per_model = _per_model(shape.model, shape.plan, _flow(shape.model, shape.plan), config.sequence_parallel)
    if layout_facts(config).recompute != "none":
        # the recomputed forward of each checkpointed layer runs its collectives again (selective recomputation
        # keeps the matmuls' outputs, not the gathered inputs they need for their weights' gradients), up to the
        # layer's last, whose output no saved tensor needs (the dry run's ledger: TP 2 + SP, 4 layers, +32 %)
        for op, calls in per_model[2].items():
            calls = round(calls * layers / max(len(shape.plan.layers), 1))
            if calls:
                est.add_comm("tp", calls * act, op, calls=calls, per="micro_batch")
    matched = per_model[1]
    head = matched.get(shape.plan.lm_head) if shape.holds_head else None
    if head in ("colwise_gather_output", "colwise_rep"):
        chunk = layout_facts(config).loss_chunk
        if chunk:  # the chunked loss: per chunk, the max, then the sum of exponentials with the target logit
            calls = 2 * -(-tokens // chunk)
            est.add_comm("tp", 3 * tokens * 4, "all_reduce", calls=calls, per="micro_batch")
        elif config.loss_parallel:  # max, target logit and sum of exponentials of each token, fp32
            est.add_comm("tp", 3 * tokens * 4, "all_reduce", calls=3, per="micro_batch")
        else:  # the logits gathered over the vocabulary
            vocab = getattr(_text(shape.model_config), "vocab_size", 0)
            est.add_comm("tp", tokens * vocab * shape.activation_bytes(config), "all_gather", per="micro_batch")


def _text(model_config):
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def _hidden(model_config) -> int:
    return _text(model_config).hidden_size


_FLOW_CACHE: dict = {}
# styles whose module reduces its own input's gradient when its region does not (one all-reduce each)
_REDUCES_INPUT = {"colwise", "unit_colwise", "colwise_gather_output", "colwise_rep", "packed_colwise",
                  "moe_tp_experts", "conv1d_colwise", "conv1d_packed_colwise", "mla_kv_a_proj"}
_SUMS_OUTPUT = {"rowwise", "unit_rowwise", "rowwise_split_input", "rowwise_rep", "moe_tp_experts", "conv1d_rowwise"}


def _flow(model, plan):
    """The trace's verdict for ``model``: the one its workers acted on when it is (a copy of) a parallelized
    model, whose own modules no longer run on the meta device, else traced here."""
    from .regions import rank_local_params

    if getattr(model, "_ultrascale_tp_flow", None) is not None:
        return model._ultrascale_tp_flow
    key = (id(model), tuple(sorted(plan.tp_plan.items())))
    if key not in _FLOW_CACHE or _FLOW_CACHE[key][0] is not model:
        _FLOW_CACHE[key] = (model, rank_local_params(model, plan))
    return _FLOW_CACHE[key][1]


_PER_CACHE: dict = {}


def _per_model(model, plan, flow, sp: bool):
    """Calls of each activation collective for all of ``model``'s regions, and the plan's matches: computed once
    per (model, plan, sp) — the planner's search prices thousands of layouts of one model."""
    from ...models.plan import region_holding
    from .regions import simple_regions

    key = (id(model), id(flow), tuple(plan.regions), sp)
    if key in _PER_CACHE and _PER_CACHE[key][0] is model:
        return _PER_CACHE[key][1]
    matched = plan.matches(model)
    simple = simple_regions(plan, matched)
    inside: dict[str, list[str]] = {r: [] for r in plan.regions}
    for fqn, style in matched.items():
        region = region_holding(fqn, inside)
        if region is not None:
            inside[region].append(style)
    per: dict[str, float] = {"all_reduce": 0.0, "all_gather": 0.0, "reduce_scatter": 0.0}
    again = dict(per)  # the forward's collectives a recomputing layer runs again in its backward
    last: dict[str, str] = {}  # each decoder layer's last forward collective, which its recomputation stops before
    for region, styles in inside.items():
        rows = sum(1 for s in styles if s in _SUMS_OUTPUT)
        whole = region in simple or region in flow.sums  # its output reduced once
        inputs = 1 if region in flow.block else sum(1 for s in styles if s in _REDUCES_INPUT)
        if sp:
            per["all_gather"] += 2  # its input (forward); the gradient of its output's shards (backward)
            per["reduce_scatter"] += (1 if whole else 0) + (1 if region in flow.block else 0)
            per["all_reduce"] += (0 if whole else rows) + (0 if region in flow.block else inputs)
            forward = {"all_gather": 1, "reduce_scatter": 1 if whole else 0, "all_reduce": 0 if whole else rows}
        else:
            per["all_reduce"] += (1 if whole else rows) + inputs
            forward = {"all_reduce": 1 if whole else rows}
        layer = next((fqn for fqn in plan.layers if region.startswith(fqn + ".")), None)
        if layer is not None:
            for op, calls in forward.items():
                again[op] += calls
            last[layer] = "reduce_scatter" if sp and whole else "all_reduce"
    for op in last.values():
        again[op] -= 1
    _PER_CACHE[key] = (model, (per, matched, again))
    return per, matched, again


def activation_collectives(model, plan, sp: bool, holds_pre: bool, holds_head: bool, layers: int) -> dict:
    """Calls per micro-batch of each activation collective (each the whole b·s·h) on a rank holding ``layers``
    decoder layers (and the embedding, the head): region by region as ``dims.tensor.plugin`` sets them up."""
    flow = _flow(model, plan)
    per, matched, _ = _per_model(model, plan, flow, sp)
    n_layers = max(len(plan.layers), 1)
    out = {op: round(calls * layers / n_layers) for op, calls in per.items()}
    embedding = matched.get(plan.embedding) in ("embedding_rowwise", "vocab_parallel_embedding")
    head = plan.lm_head in matched
    if holds_pre:
        if sp:
            out["all_gather"] += 1  # the split's backward: the embedding needs its whole gradient
            if embedding:
                out["reduce_scatter" if flow.start else "all_reduce"] += 1
        elif embedding:
            out["all_reduce"] += 1
    if holds_head and head:
        if sp:
            out["all_gather"] += 1  # the last layer's gather
            out["reduce_scatter" if flow.end is not None else "all_reduce"] += 1
        else:
            out["all_reduce"] += 1
    return out

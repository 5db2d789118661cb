"""Data parallel's least communication for one optimizer step on one rank (``ultrascale_cost_comm_minimum``), in the
notation of ``interface.comm_minimum``: the gradients reduced once per step (Ψg) and the updated weights gathered
once; ZeRO-2 keeps gradients sharded across accumulation, so it reduce-scatters every micro-batch, and ZeRO-3
gathers every weight for each forward and each backward (with ``grad_sync: step``, both once per step). Each mesh
view's parameters (experts over ``efsdp``) over that view's gradient axes."""
from __future__ import annotations

import math

from ...interface.comm_minimum import MinimumTerm
from ...interface.facts import layout_facts
from ...interface.parallel_dims import ParallelDims


def data_parallel_minimum(config, shape) -> list[MinimumTerm]:
    """The terms of each group of parameters (the plain ones, each mesh view's) over its gradient axes."""
    dims = ParallelDims(config)
    out = []
    by_view: dict[str, list] = {}
    for r in shape.inventory:
        by_view.setdefault(r.view or "", []).append(r)
    for view, records in by_view.items():
        axes = [a for a in (dims.grad_axes if not view else dims.view_grad_axes(view)) if dims.degree(a) > 1]
        if axes:
            out.extend(_group_terms(config, shape, dims, records, axes))
    return out


def _group_terms(config, shape, dims, records, axes: list[str]) -> list[MinimumTerm]:
    zero = int(config.zero_stage)
    m = shape.micro_batches
    weight = 2 if config.mixed_precision == "bf16" else 4
    grads = 4 * sum(r.local_numel for r in records if r.trainable)  # reduced in fp32
    trained = weight * sum(r.local_numel for r in records if r.trainable)
    every = weight * sum(r.local_numel for r in records)
    shard = next((a for a in ("dp_shard", "efsdp") if a in axes), None) if zero >= 1 else None
    rest = [a for a in axes if a != shard]
    if shard is None:
        return [MinimumTerm("+".join(rest), "all_reduce", 1, grads, "the gradients, Ψg, once per step")]
    # ZeRO-1 keeps whole gradients; a pipeline's stages keep them for the step; grad_sync says it where it is set
    per_step = config.grad_sync == "step" if config.grad_sync != "auto" else (
        zero == 1 or layout_facts(config).degree("pp") > 1)
    reductions = 1 if per_step else m
    out = [MinimumTerm(shard, "reduce_scatter", reductions, reductions * grads,
                       "the gradients, Ψg, " + ("once per step" if reductions == 1 else
                                                "every micro-batch (they accumulate sharded)"))]
    if zero == 3 and not per_step:
        out.append(MinimumTerm(shard, "all_gather", 2 * m, 2 * m * every,
                               "every weight, Ψw, for each forward and each backward of every micro-batch"))
    elif zero == 3:
        out.append(MinimumTerm(shard, "all_gather", 1, every, "every weight, Ψw, once per step (kept gathered "
                               "across the step's micro-batches)"))
    else:
        out.append(MinimumTerm(shard, "all_gather", 1, trained, "the updated weights, Ψw of the trained ones, once "
                               "per step"))
    if rest:
        share = math.ceil(grads / dims.degree(shard))
        out.append(MinimumTerm("+".join(rest), "all_reduce", reductions, reductions * share,
                               "each reduce-scatter's shard of the gradients, Ψg/dp_shard, over the replicas"))
    return out

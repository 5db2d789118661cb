"""Data parallel's part of a layout's cost: the parameter, gradient and optimizer bytes of this rank's
parameters (what the pipeline and tensor parallel left it) sharded as its ZeRO stage says — FSDP2's dim-0 chunks,
or ``ZeroRedundancyOptimizer``'s partition of whole tensors — and the data-parallel collectives of a step."""
from __future__ import annotations

import math

from ...interface.estimates import LOW_BIT_STATES, OPTIMIZERS, Estimate, chunk_size, state_bytes
from ...interface.facts import layout_facts


def precision_bytes(config, profile: str) -> tuple[int, int, int]:
    """(bytes per parameter element, per gradient element, per optimizer-state element beyond Adam's moments:
    the fp32 master copy) for this layout's precision and profile."""
    if profile == "nanotron":
        return 2, 2 + 4, 4  # bf16 weights; bf16 grads + fp32 accumulation buffer; fp32 master weights
    if profile == "megatron_deepspeed":
        return 2, 2, 4  # 16-bit weights, 16-bit gradients accumulated in place; fp32 master weights
    held = param_bytes(config)
    return held, held, 0  # weights and gradients as held (param_dtype; bf16 compute alone keeps them fp32)


def deepspeed_zero1_step(elements: float, dp: int) -> float:
    """Bytes beside the model states that DeepSpeed's ZeRO-1 (``DeepSpeedZeroOptimizer``, stage_1_and_2.py) holds
    around the step of ``elements`` trained 16-bit parameters over ``dp`` ranks, the larger of two moments (neither
    beside the activations): the reduction's 16-bit bucket (``reduce_bucket_size``, 5e8 elements by default), freed
    before the step; and the step's own, which frees the 16-bit gradients of the parameters other ranks update,
    then makes a flat 16-bit copy of its partition's and that copy in fp32 (the master weights' gradient)."""
    part = elements / dp
    bucket = 2 * min(5e8, elements)
    step = (2 + 4) * part - 2 * (elements - part)
    return max(bucket, step)


def param_bytes(config) -> int:
    """Bytes of a parameter element as held (``param_dtype``): its gradient's and its optimizer states' too."""
    return 2 if getattr(config, "param_dtype", "fp32") == "bf16" else 4


def grad_sync(config, degrees=None) -> str:
    """``grad_sync`` as it runs: ``auto`` is ``step`` for ZeRO-0 and ZeRO-1 (they reduce once per step by
    definition) and inside a pipeline (torch's stages defer FSDP2's reduce-scatter to a step's last micro-batch),
    else ``micro_batch`` (FSDP2 reduce-scatters after every backward: the gradients accumulate sharded).
    ``degrees``: the mesh degrees by axis name (default: the layout's)."""
    value = getattr(config, "grad_sync", "auto")
    if value != "auto":
        return value
    degrees = layout_facts(config).degrees if degrees is None else degrees
    return "step" if config.zero_stage <= 1 or degrees.get("pp", 1) > 1 else "micro_batch"


def zero1_on_fsdp(config, degrees) -> bool:
    """ZeRO-1 over tensor-parallel (DTensor) parameters, which DDP and ``ZeroRedundancyOptimizer`` cannot hold:
    FSDP2 sharded over every data-parallel rank (one flattened axis), gathered for the step, reduced once."""
    return (config.zero_stage == 1 and degrees.get("tp", 1) > 1
            and config.dp_replicate * config.dp_shard > 1)


def layout_facts_of(config, degrees) -> dict:
    """What data parallel decides for the other families (``facts.LayoutFacts``)."""
    zero, shard = config.zero_stage, degrees.get("dp_shard", 1)
    return {"fsdp_units": zero >= 2,
            "fsdp_shards": shard if zero >= 2 and shard > 1 else 1,
            "states_sharded": zero1_on_fsdp(config, degrees) or (zero >= 2 and shard > 1),
            "grad_reduce": grad_sync(config, degrees) if zero >= 2 else "step",
            "compute_bytes": 2 if "bf16" in (config.mixed_precision, config.param_dtype) else 4,
            "param_bytes": param_bytes(config),
            "params_on_host": bool(config.cpu_offload)}


def data_parallel_terms(config, shape, est: Estimate) -> None:
    """Parameter, gradient and optimizer bytes of this rank's (already pipeline- and TP-cut) parameters, sharded
    as ZeRO says; the data-parallel collectives per step: as the memory profile's implementation holds them."""
    terms = PROFILE_TERMS.get(shape.profile)
    if terms is None:
        raise ValueError(f"memory profile {shape.profile!r}: one of {', '.join(PROFILE_TERMS)}")
    terms(config, shape, est)


def ultrascale_terms(config, shape, est: Estimate) -> None:
    """This package's data parallel: FSDP2 (ZeRO-2 and 3, and ZeRO-1 over tensor-parallel parameters), else DDP
    with ``ZeroRedundancyOptimizer`` (ZeRO-1); weights, gradients and optimizer states as held (``param_dtype``),
    the weights gathered (or, under autocast, cast) in the compute dtype."""
    dp = config.dp_shard * config.dp_replicate
    pbytes, gbytes, master = precision_bytes(config, "ultrascale")
    on_fsdp = zero1_on_fsdp(config, layout_facts(config).degrees)
    records, local, trainable = _rank_parameters(config, shape, on_fsdp)
    if config.zero_stage == 1 and dp > 1 and not on_fsdp:
        opt_numel, opt_tensors = _zero1_share(trainable, dp, shape.coords, config.dp_shard)
        state = state_bytes(shape.optimizer, opt_numel, pbytes)  # the partition, priced as one tensor
    else:
        opt_numel, opt_tensors, state = _states_per_parameter(shape.optimizer, trainable, pbytes)
    _add_model_states(config, shape, est, local, trainable, (pbytes, gbytes, master), (opt_numel, opt_tensors, state))
    if shape.optimizer in ("adam", "adamw"):
        # the optimizer step's own memory: torch's foreach Adam/AdamW (a GPU user's default) makes one temporary,
        # the square root of the second moments (the fused implementation needs none); see
        # Estimate.optimizer_step_memory. torchao's low-bit AdamW steps one parameter at a time.
        one = max((n for _, n in trainable), default=0) if layout_facts(config).grads_freed_in_backward else opt_numel
        est.factors["step_temporary"] = est.factors.get("step_temporary", 0.0) + pbytes * one
    _add_compute_copies(config, shape, est, records, local, trainable, (pbytes, gbytes), on_fsdp)
    if dp <= 1:
        return
    if config.zero_stage <= 1 and layout_facts(config).degree("pp") == 1 and not on_fsdp:
        # DDP's gradient buckets: a flat copy of every gradient, in the gradients' dtype
        full_local = sum(r.local_numel for r in records if r.trainable)
        est.add_memory("other", gbytes * full_local)
        est.factors["step_other"] = est.factors.get("step_other", 0.0) + gbytes * full_local  # held through the step
    # gradients reduced in fp32 (FSDP2's reduce_dtype), except bf16 weights (param_dtype: bf16), whose gradients
    # are reduced as they are held
    _add_dp_collectives(config, shape, est, records, gbytes, 2 if config.mixed_precision == "bf16" else pbytes)


def nanotron_terms(config, shape, est: Estimate) -> None:
    """nanotron's data parallel: bf16 weights, bf16 gradients beside an fp32 accumulation buffer, fp32 master weights
    and optimizer states; ZeRO-1 partitions whole weights' states evenly; torch DDP's buckets (ZeRO-0); gradients
    reduced from the fp32 accumulator."""
    dp = config.dp_shard * config.dp_replicate
    pbytes, gbytes, master = precision_bytes(config, "nanotron")
    records, local, trainable = _rank_parameters(config, shape, on_fsdp=False)  # its ZeRO-1 keeps whole weights
    _add_model_states(config, shape, est, local, trainable, (pbytes, gbytes, master),
                      _fp32_states(config, shape.optimizer, trainable, dp))
    if dp <= 1:
        return
    if config.zero_stage == 0:  # torch DDP's buckets in the weights' dtype (nanotron: ZeRO-0 only)
        est.add_memory("other", 2 * sum(r.local_numel for r in records if r.trainable))
    _add_dp_collectives(config, shape, est, records, 4, 2)  # fp32 gradients (the accumulator's), bf16 weights


def megatron_deepspeed_terms(config, shape, est: Estimate) -> None:
    """Megatron-DeepSpeed's data parallel: 16-bit weights and gradients (accumulated in place), fp32 master weights
    and optimizer states, ZeRO-1's even partition, and what DeepSpeed's ZeRO-1 holds around the step."""
    dp = config.dp_shard * config.dp_replicate
    pbytes, gbytes, master = precision_bytes(config, "megatron_deepspeed")
    records, local, trainable = _rank_parameters(config, shape, on_fsdp=False)
    _add_model_states(config, shape, est, local, trainable, (pbytes, gbytes, master),
                      _fp32_states(config, shape.optimizer, trainable, dp))
    if config.zero_stage == 1:
        est.factors["step_other"] = est.factors.get("step_other", 0.0) + deepspeed_zero1_step(
            sum(n for _, n in trainable), dp)
    if dp <= 1:
        return
    _add_dp_collectives(config, shape, est, records, gbytes, pbytes)  # both 16-bit on the wire


PROFILE_TERMS = {"ultrascale": ultrascale_terms, "nanotron": nanotron_terms,
                 "megatron_deepspeed": megatron_deepspeed_terms}  # interface.estimates.PROFILES, in its order


def _rank_parameters(config, shape, on_fsdp: bool) -> tuple[list, list, list]:
    """(the inventory's records, [(record, elements this rank holds)], those of them that train): each (TP-local)
    parameter whole, or its shard as ZeRO says."""
    records = [r for r in shape.inventory if r.local_numel or r.numel]
    dp_shard, coords = config.dp_shard, shape.coords
    if on_fsdp:
        # FSDP2's dim-0 chunks of every (TP-local) parameter over the flattened data-parallel ranks
        dp = dp_shard * config.dp_replicate
        k = coords.get("dp_replicate", 0) * dp_shard + coords.get("dp_shard", 0)
        local = [(r, (chunk_size(r.local[0], dp, k) if r.local else 0) * math.prod(r.local[1:])) for r in records]
    elif config.zero_stage >= 2:
        # FSDP2 shards dim 0 of every (TP-local) parameter over dp_shard, torch.chunk-style; HSDP replicates over
        # dp_replicate. The most loaded rank is shard 0.
        s = coords.get("dp_shard", 0)
        local = []
        dims = _dims_of(config) if any(r.view for r in records) else None
        for r in records:
            if r.view:  # in a mesh view: sharded over the view's last gradient axis (shard_view_modules)
                local.append((r, _view_shard(dims, r, coords)))
                continue
            rows = chunk_size(r.local[0], dp_shard, s) if r.local else 0
            local.append((r, rows * math.prod(r.local[1:])))
    else:
        local = [(r, r.local_numel) for r in records]
    return records, local, [(r, n) for r, n in local if r.trainable]


def _states_per_parameter(optimizer: str, trainable, sbytes: int) -> tuple[float, int, float]:
    """(state elements counted in fp32 elements, state tensors, bytes of one state) over the shards this rank
    holds (ZeRO-0, 2 and 3): each state in its parameter's dtype (held_bytes: one held in another dtype), or
    low-bit."""
    opt_numel = sum(n * (r.held_bytes or 4) / 4 for r, n in trainable)
    state = sum(state_bytes(optimizer, n, r.held_bytes or sbytes) for r, n in trainable)
    return opt_numel, len(trainable), state


def _fp32_states(config, optimizer: str, trainable, dp: int) -> tuple[float, float, float]:
    """``_states_per_parameter`` for the 16-bit profiles, which keep fp32 states beside their fp32 master weights;
    their ZeRO-1 partitions the states evenly (a flat buffer's share)."""
    if config.zero_stage == 1 and dp > 1:
        opt_numel, opt_tensors = sum(n for _, n in trainable) / dp, len(trainable) / dp
        return opt_numel, opt_tensors, state_bytes(optimizer, opt_numel, 4)
    return _states_per_parameter(optimizer, trainable, 4)


def _add_model_states(config, shape, est: Estimate, local, trainable, precision: tuple, optimizer: tuple) -> None:
    """The params, grads and optimizer memory: ``precision`` (bytes of a weight, of a gradient, of the master
    copy per state element: ``precision_bytes``), ``optimizer`` (state elements, state tensors, bytes of one
    state)."""
    pbytes, gbytes, master = precision
    opt_numel, opt_tensors, state = optimizer
    est.add_memory("params", sum(n * (r.held_bytes or pbytes) for r, n in local))
    if layout_facts(config).grads_freed_in_backward:
        # each group's gradients are stepped and freed as soon as they are reduced: the largest group's at once
        # (the root's, or a layer's), and the optimizer steps one parameter at a time (its temporaries: one's)
        groups: dict = {}
        for r, n in trainable:
            groups[r.layer] = groups.get(r.layer, 0) + n * (r.held_bytes or gbytes)
        est.add_memory("grads", max(groups.values(), default=0))
    else:
        est.add_memory("grads", sum(n * (r.held_bytes or gbytes) for r, n in trainable))
    adam = shape.optimizer in ("adam", "adamw", *LOW_BIT_STATES)
    step_counters = 4 * opt_tensors if adam else 0  # Adam's 0-d fp32 step
    est.add_memory("optimizer", OPTIMIZERS[shape.optimizer] * state + master * opt_numel + step_counters)
    est.factors["optimizer_elements"] = opt_numel  # what the optimizer steps on this rank: its time (planner/cost.py)


def _add_compute_copies(config, shape, est: Estimate, records, local, trainable, precision: tuple,
                        on_fsdp: bool) -> None:
    """The weights in the compute dtype beside the held ones (``ultrascale_terms``): FSDP2's gathered weights and
    the whole gradients waiting for their reduce-scatter (with ``cpu_offload``, the host's part too), or DDP's
    bf16 copy under autocast. ``precision``: (bytes of a weight, of a gradient) as held."""
    pbytes, gbytes = precision
    zero, once = config.zero_stage, grad_sync(config) == "step"
    compute = 2 if config.mixed_precision == "bf16" else pbytes
    if (zero >= 2 and config.dp_shard > 1) or on_fsdp or config.cpu_offload:
        # FSDP2 gathers whole weights in the compute dtype: under ZeRO-3 reduced every micro-batch the root
        # group's (embedding, head, final norm: never resharded) plus a layer and the next (prefetched), else
        # (ZeRO-1 and 2, or grad_sync: step) all of them, for the whole step. A layer's whole fp32 gradient
        # waits for its reduce-scatter; with grad_sync: step over several micro-batches (a pipeline's, or
        # gradient accumulation's) every whole fp32 gradient is held until the step's last backward
        per_layer = zero == 3 and not once
        full_local = sum(r.local_numel for r in records if r.trainable)  # what has gradients
        largest_trained = max(_layer_sizes(records)[1].values(), default=0)
        whole_grads = full_local if once and shape.micro_batches > 1 else largest_trained

        def gathered(recs) -> float:  # in the compute dtype, or as held when that is smaller (a 4-bit base)
            return sum(r.local_numel * (min(compute, r.held_bytes) if r.held_bytes else compute) for r in recs)

        if per_layer:
            by_layer: dict = {}
            for r in records:
                by_layer.setdefault(r.layer, []).append(r)
            root = by_layer.pop(None, [])
            held = gathered(root) + 2 * max((gathered(rs) for rs in by_layer.values()), default=0)
        else:
            held = gathered(records)
        est.add_memory("other", held + gbytes * whole_grads)
        if config.cpu_offload:
            host_terms(est, local, trainable, pbytes, gbytes, per_layer, once, shape.micro_batches)
    elif compute == 2 and pbytes == 4:  # DDP under autocast caches a bf16 copy of every fp32 weight in the forward
        est.add_memory("other", 2 * sum(r.local_numel for r in records))  # frozen ones included


def _add_dp_collectives(config, shape, est: Estimate, records, grad_wire: int, weight_wire: int) -> None:
    """The data-parallel collectives of a step (``dp`` > 1): bytes of a gradient element and of a weight
    element on the wire."""
    if config.zero_stage >= 2:
        _add_fsdp_collectives(config, shape, est, records, grad_wire, weight_wire)
        return
    dp_shard, dp_rep = config.dp_shard, config.dp_replicate
    full_local = sum(r.local_numel for r in records if r.trainable)
    for axis in [a for a, d in (("dp_replicate", dp_rep), ("dp_shard", dp_shard)) if d > 1]:
        # DDP's all-reduce (ZeRO-1: reduce-scatter + all-gather, the same volume)
        share = (dp_rep if axis == "dp_replicate" else dp_shard) / (dp_shard * dp_rep)
        if config.zero_stage == 1:
            est.add_comm(axis, grad_wire * full_local * share, "reduce_scatter", overlap=shape.dp_overlap)
            est.add_comm(axis, weight_wire * full_local * share, "all_gather")
        else:
            est.add_comm(axis, grad_wire * full_local * share, "all_reduce", calls=max(1, _n_layers(records)),
                         overlap=shape.dp_overlap)


def _add_fsdp_collectives(config, shape, est: Estimate, records, grad_wire: int, weight_wire: int) -> None:
    """Reduce-scatter of the gradients after every micro-batch (grad_sync: micro_batch: they accumulate sharded)
    or once, after the step's last (step); all-gathers of the weights, frozen ones too: ZeRO-3 reduced every
    micro-batch before each forward and each backward of every micro-batch, prefetched, else once per step (the
    weights stay gathered over the step's micro-batches). The root group (embedding, final norm, head) stays
    gathered from its forward to its backward. Parameters in a mesh view (experts) are sharded over the view's
    own last gradient axis, in groups of their own: their collectives run there (none on one rank). HSDP
    all-reduces the shards' gradients over dp_replicate."""
    once = grad_sync(config) == "step"
    again = config.zero_stage == 3 and not once  # ZeRO-3 gathers each layer again for its backward
    groups = {"": ("dp_shard", config.dp_shard)}
    if any(r.view for r in records):
        dims = _dims_of(config)
        for view in {r.view for r in records if r.view}:
            axis = dims.view_grad_axes(view)[-1]
            groups[view] = (axis, dims.degree(axis))
    for view, (axis, degree) in groups.items():
        mine = [r for r in records if r.view == view]
        if degree <= 1 or not mine:
            continue
        sizes, _ = _layer_sizes(mine)
        weights = sum(r.local_numel for r in mine)
        root = weights - sum(sizes.values())
        n = len(sizes) + (1 if root else 0)
        est.add_comm(axis, grad_wire * sum(r.local_numel for r in mine if r.trainable), "reduce_scatter",
                     calls=n, overlap=shape.dp_overlap, per="step" if once else "micro_batch")
        est.add_comm(axis, weight_wire * (weights + (weights - root if again else 0)), "all_gather",
                     calls=n + (len(sizes) if again else 0), per="micro_batch" if again else "step",
                     overlap=shape.gather_overlap)
    if config.dp_replicate > 1:
        full_local = sum(r.local_numel for r in records if r.trainable)
        est.add_comm("dp_replicate", grad_wire * full_local / config.dp_shard, "all_reduce", overlap=shape.dp_overlap)


def host_terms(est: Estimate, local, trainable, pbytes: int, gbytes: int, per_layer: bool, once: bool,
               micro_batches: int) -> None:
    """``cpu_offload`` (FSDP2's ``CPUOffloadPolicy``): the shards, their gradients and the optimizer states on the
    host. The host link carries the shards in before every all-gather (ZeRO-3 reduced every micro-batch: each
    forward and each backward, else once a step) and the reduced gradients out after every reduce-scatter; the
    optimizer steps on the host. (A group's shard copied in for its all-gather is on the device only until the
    gather's input is made: not at the step's peak, the start of the loss's backward.)"""
    est.on_host.update(("params", "grads", "optimizer"))
    layers: dict = {}
    for r, n in local:
        if r.layer is not None:
            layers[r.layer] = layers.get(r.layer, 0) + n
    shards = sum(n for _, n in local)
    root = shards - sum(layers.values())
    weights_in = pbytes * (shards + (shards - root if per_layer else 0)) * (micro_batches if per_layer else 1)
    grads_out = gbytes * sum(n for _, n in trainable) * (1 if once else micro_batches)
    est.factors["host_copy_bytes"] = est.factors.get("host_copy_bytes", 0.0) + weights_in + grads_out
    est.factors["host_step_elements"] = est.factors.get("host_step_elements", 0.0) + sum(n for _, n in trainable)


def _view_shard(dims, r, coords) -> int:
    """Elements of ``r`` (a parameter in a mesh view) this rank holds under FSDP2 over the view's last gradient
    axis: dim 0 in chunks, or dim 1 when dim 0 does not split evenly (``data_parallel.shard_view_modules``).
    ``dims``: the layout's ``ParallelDims``."""
    axis = dims.view_grad_axes(r.view)[-1]
    shards, index = dims.degree(axis), coords.get(axis, 0)
    dim = 1 if len(r.local) > 1 and r.local[0] % shards else 0
    cut = list(r.local)
    cut[dim] = chunk_size(cut[dim], shards, index)
    return math.prod(cut)


_DIMS: dict = {}


def _dims_of(config):
    """The layout's ``ParallelDims`` (no mesh), once per layout: the planner costs many records of each."""
    from ...interface.parallel_dims import ParallelDims

    key = repr(config.to_dict())
    if key not in _DIMS:
        _DIMS.clear()
        _DIMS[key] = ParallelDims(config)
    return _DIMS[key]


def _layer_sizes(records) -> tuple[dict, dict]:
    """({layer: its TP-local elements}, {layer: those that train}): what FSDP2 gathers, and reduces, per layer."""
    sizes: dict = {}
    trained: dict = {}
    for r in records:
        if r.layer is not None:
            sizes[r.layer] = sizes.get(r.layer, 0) + r.local_numel
            trained[r.layer] = trained.get(r.layer, 0) + (r.local_numel if r.trainable else 0)
    return sizes, trained


def _n_layers(records) -> int:
    return len({r.layer for r in records if r.layer is not None})


def _zero1_share(trainable, dp: int, coords, dp_shard: int) -> tuple[float, float]:
    """ZeRO-1 as ``torch.distributed.optim.ZeroRedundancyOptimizer`` partitions: parameters by size, largest
    first, each to the rank holding the fewest elements so far. (elements, tensors) of one rank: ``coords``'
    data-parallel rank, else the most loaded."""
    sizes, counts = [0] * dp, [0] * dp
    for n in sorted((n for _, n in trainable), reverse=True):
        k = sizes.index(min(sizes))
        sizes[k] += n
        counts[k] += 1
    if "dp_shard" in coords or "dp_replicate" in coords:  # the flattened (dp_replicate, dp_shard) group rank
        k = coords.get("dp_replicate", 0) * dp_shard + coords.get("dp_shard", 0)
        return sizes[k], counts[k]
    k = sizes.index(max(sizes))
    return sizes[k], counts[k]

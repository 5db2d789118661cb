"""The search: every layout of the GPUs worth costing, ranked.

Degrees are divisors of the GPU count (TP inside a node, PP at most one stage per layer, CP only where each rank
keeps at least 4k tokens), every ZeRO stage, micro-batches that split the global batch, and for pipelines the
1F1B, interleaved and zero-bubble V schedules; with each, every combination of the values the plugins offer for
their own layout fields (``ultrascale_cost_search``'s choices: expert parallelism's degrees). Recomputation is tried
only when a layout does not fit without it, and larger micro-batches only while the smaller ones fit: both only add
time otherwise. What saves memory at a price (the offers' savers, then lossy) is searched only when no layout fits
without it: first what costs time (the chunked loss, states on the host), then what changes the numbers (states in
bf16). Among the layouts that fit, those with room for the memory estimate's error rank first (``headroom``);
when none has that room, ``room_elsewhere`` looks for it on more GPUs and with the memory savers.
"""
from __future__ import annotations

import dataclasses
import math

from .cost import CostModel, Layout, Result
from .headroom import MEMORY_MARGIN, first_with_headroom, prefer_headroom

RECOMPUTE = ("none", "selective", "full")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pp_schedules(pp: int, layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    if layers >= 2 * pp:
        out += [("interleaved_1f1b", 2), ("zbv", 1)]
    return out


def degree_combinations(world: int, model, hw, seq_len: int, global_batch: int):
    """(tp, cp, pp, dp) tuples of ``world``."""
    layers = model.config.num_hidden_layers
    for tp in divisors(world):
        if tp > hw.gpus_per_node:
            continue
        for cp in divisors(world // tp):
            if cp > 1 and seq_len // cp < 4096:
                continue
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if pp > layers or global_batch % dp:
                    continue
                yield tp, cp, pp, dp


def layouts(world: int, cost: CostModel, savers: int = 0):
    """Every candidate layout, grouped so that the search can stop growing one that stops fitting; ``savers``:
    only those with a memory saver on (``CostModel.plugin_choices``)."""
    spec, hw, work = cost.spec, cost.hw, cost.work
    layers = spec.config.num_hidden_layers
    for tp, cp, pp, dp in degree_combinations(world, spec, hw, work.seq_len, work.global_batch):
        # one data-parallel rank: ZeRO-3's FSDP2 groups cost as plain data parallel, except with a saver (offload)
        for zero in (((0, 3) if savers else (0,)) if dp == 1 else (0, 1, 2, 3)):
            replicas = [1]
            per_node = max(1, hw.gpus_per_node // (tp * cp))
            if zero >= 2 and dp > per_node and dp % per_node == 0:
                replicas.append(dp // per_node)  # HSDP: shard inside a node, replicate across nodes
            for rep in replicas:
                # the search's own choices: every ZeRO stage, the workload's precision, Megatron's sequence
                # parallelism whenever tensor parallel
                base = Layout(dp_replicate=rep, dp_shard=dp // rep, tp=tp, pp=pp, cp=cp, zero_stage=zero,
                              mixed_precision=work.precision, sequence_parallel=tp > 1, registry=cost.pm)
                for offered in cost.plugin_choices(base, world, savers):
                    for schedule, v in _pp_schedules(pp, layers):
                        group = []
                        rows, mbs = work.global_batch // dp, 1
                        while rows % mbs == 0:
                            ga = rows // mbs
                            if pp == 1 or ga >= pp:
                                group.append([base.replace(micro_batch_size=mbs, grad_accum=ga,
                                                           activation_checkpointing=ac, pp_schedule=schedule,
                                                           pp_virtual_stages=v, **offered)
                                              for ac in RECOMPUTE])
                            mbs *= 2
                        yield group


def search(cost: CostModel, world: int, *, include_unrunnable: bool = False, limit: int | None = None,
           margin: float = MEMORY_MARGIN, lossy: bool = True) -> list[Result]:
    """Costed layouts, best first: those that fit before those that don't, then by predicted tokens/s/GPU, except
    that every layout leaving room for the memory estimate's error (``margin``) goes first
    (``headroom.prefer_headroom``). Layouts this engine cannot run are left out unless
    ``include_unrunnable``. ``lossy=False``: never the memory savers that change the numbers (``layout: auto``
    does not choose them for a run)."""
    results = _costed(layouts(world, cost), cost, include_unrunnable)
    for savers in ((1, 2) if lossy else (1,)):  # the memory savers: at a price in time, then in precision
        if any(r.fits for r in results):
            break
        results += _costed(layouts(world, cost, savers=savers), cost, include_unrunnable)
    results.sort(key=rank_key(results))
    results = prefer_headroom(results, cost.hw.memory_gb, margin)
    return results[:limit] if limit else results


def _costed(groups, cost: CostModel, include_unrunnable: bool) -> list[Result]:
    results: list[Result] = []
    for group in groups:
        for variants in group:  # one micro-batch size, each recomputation mode
            first = variants[0]
            ok, _ = cost.runnable(first)
            if not ok and not include_unrunnable:
                continue
            fitted = None
            for lay in variants:
                result = cost.evaluate(lay)
                if not result.runnable and not include_unrunnable:
                    continue
                results.append(result)
                if result.fits:
                    fitted = result
                    break
            if fitted is None:
                break  # a larger micro-batch needs more memory still
    return results


def rank_key(results: list[Result]):
    """Best first: those that fit, runnable ones, then by predicted tokens/s/GPU. When none fits, the closest
    first: by how full the fuller memory is (the device's, or the host's for offloaded states)."""
    if any(r.fits for r in results):
        return lambda r: (not r.fits, not r.runnable, -r.tokens_per_s_per_gpu)
    return lambda r: (not r.runnable, r.load, -r.tokens_per_s_per_gpu)


def best_layout(cost: CostModel, world: int, results: list[Result] | None = None) -> Result:
    """The best runnable layout that fits (of ``results`` when the search has run already); raises when none
    does."""
    from ..interface.config import ConfigError

    results = search(cost, world) if results is None else results
    if not results or not results[0].fits:
        need = min((r.memory_gb["total"] for r in results), default=math.inf)
        raise ConfigError(f"no layout of {world} GPUs fits {cost.hw.memory_gb:g} GB per GPU (the smallest needs "
                          f"{need:.1f} GB). Fix: use more GPUs, a shorter sequence or a smaller global batch")
    return results[0]


# how far room_elsewhere looks for more GPUs: doublings of the job's count up to this factor
MORE_GPUS_FACTOR = 8


@dataclasses.dataclass
class RoomElsewhere:
    """Where the memory estimate's margin is found when no layout of the job's GPUs leaves it: the smallest GPU
    count the search tried that has a layout with it (and that layout), and the fastest layout of the job's GPUs
    with the memory savers that keep the numbers (offloaded states, the chunked loss, ...) that has it, and with
    those that change them (bf16 states); None where none was found."""

    gpus: int | None = None
    on_more_gpus: Result | None = None
    with_savers: Result | None = None
    with_lossy_savers: Result | None = None
    tried_up_to: int = 0  # the largest GPU count searched


def more_gpu_counts(world: int, per_node: int, factor: int = MORE_GPUS_FACTOR) -> list[int]:
    """The GPU counts tried above ``world``: doublings, each rounded up to whole nodes once past one node."""
    counts, n = [], world
    while n * 2 <= world * factor:
        n *= 2
        if n > per_node and n % per_node:
            n = math.ceil(n / per_node) * per_node
        counts.append(n)
    return counts


# the degrees (of the best layouts at the edge) that room_elsewhere tries the memory savers on: every degree with
# every saver is the costliest search there is (a minute for a mixture of experts on one node)
SAVER_DEGREES = 3


def _degrees(lay: Layout) -> tuple:
    return lay.dp_replicate * lay.dp_shard, lay.tp, lay.pp, lay.cp


def room_elsewhere(cost: CostModel, world: int, ranked: list[Result], margin: float = MEMORY_MARGIN,
                   lossy: bool = True) -> RoomElsewhere:
    """When no layout of ``world`` GPUs leaves ``margin`` free (``ranked``: the search's results, best first): the
    smallest count of more GPUs (doublings, up to ``MORE_GPUS_FACTOR`` times) whose search has a layout that does,
    and the fastest layout with the degrees of the ``SAVER_DEGREES`` best ones and memory savers on
    (``ultrascale_cost_search``'s savers, then, with ``lossy``, its lossy ones, which change the numbers) that
    does. Each is the planner's own search, nothing extrapolated."""
    limit = cost.hw.memory_gb
    found = RoomElsewhere()
    degrees = []
    for r in ranked:
        if r.fits and _degrees(r.layout) not in degrees:
            degrees.append(_degrees(r.layout))
    degrees = degrees[:SAVER_DEGREES]
    for savers in ((1, 2) if lossy else (1,)):  # 2: each layout has a saver that changes the numbers on
        groups = (g for g in layouts(world, cost, savers=savers) if g and _degrees(g[0][0]) in degrees)
        saving = _costed(groups, cost, include_unrunnable=False)
        saving.sort(key=rank_key(saving))
        setattr(found, "with_lossy_savers" if savers == 2 else "with_savers",
                first_with_headroom(saving, limit, margin))
    for n in more_gpu_counts(world, cost.hw.gpus_per_node):
        found.tried_up_to = n
        first = first_with_headroom(search(cost, n, margin=margin, lossy=lossy), limit, margin)
        if first is not None:
            found.gpus, found.on_more_gpus = n, first
            break
    return found

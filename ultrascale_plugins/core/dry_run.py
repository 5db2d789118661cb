"""``us.dry_run``: one optimizer step of the package's real code path at full size, on fake tensors.

``parallelize`` (validation, the mesh, every stage of the layout), ``train_step``, gradient clipping and AdamW run
as in training, at the real sizes and world size, on one process: a fake process group stands for the other ranks
(its collectives return at once) and ``FakeTensorMode`` gives every tensor a shape and no storage, so a 70B model's
step runs on a laptop and no weight is ever materialized. torch's ``MemTracker`` counts the live bytes by category
at the peak, the package's communication ledger the bytes handed to the collectives per mesh axis; beside them
stands the planner's estimate for the same layout (``Estimate.total_memory``: before the GPU allocator's constants,
which a run without an allocator cannot see). The private torch tools are in ``fake_run``.

The model is built on the meta device and ``parallelize`` runs outside ``FakeTensorMode`` (the mesh's slicing and
DDP's shape check need real index tensors); only the loader (``fake_run.FakeWeights``) and the step run inside it.
A warm-up gives the optimizer its states (zero gradients and one AdamW step: no forward) so the tracked step holds
them as training does. What it does not run yet is refused in one line before any work (``refusal``), as each field declares.
"""
from __future__ import annotations

import copy
import dataclasses
import time
import warnings

import torch

from ..interface.config import ConfigError
from ..interface.fake_values import Assumptions, assuming
from .dry_run_report import DryRunReport, RoleReport

def refusal(config) -> str | None:
    """One line naming the first field of ``config`` set to a value the dry run does not run yet, or None: each
    field says so itself when it is declared (``Field.dry_run``), a third party's as the package's own."""
    for field in config.registry.fields:
        value = getattr(config, field.name, field.default)
        why = field.dry_run(config) if callable(field.dry_run) else (field.dry_run if value != field.default else "")
        if why:
            return (f"{field.name}={value}: the dry run does not run this yet ({why}). Fix: dry-run the "
                    f"layout with {field.name}={field.default}, or price it with the planner alone")
    return None


def dry_run(model_config, parallel_config, *, world_size: int, rank: int | None = None, seq_len: int,
            micro_batch_size: int = 1, grad_accum: int = 1, max_grad_norm: float = 1.0, lr: float = 1e-4,
            routing: str = "uniform") -> DryRunReport:
    """Run one optimizer step of ``parallel_config`` on ``model_config`` (a transformers config) at
    ``world_size`` ranks, on fake tensors, as each rank role the layout has (ranks that hold different parts or
    different numbers of micro-batches in flight, as the plugins say; one where every rank plays the same role),
    or as ``rank`` alone; ``grad_accum`` micro-batches of ``micro_batch_size`` rows per optimizer step, as the
    training loop runs them (gradients kept local until the last; a model that runs micro-batches inside its step
    runs them there); ``max_grad_norm`` 0: no clipping. Return the report (``report.table()``,
    ``report.to_json()``). ``ConfigError`` before any work for a layout the world size does not allow, a layout
    the dry run does not run yet, or a process group already initialized (the dry run makes, and destroys, its own fake one). Where values would decide (a
    router's choice) the step runs under stated assumptions (``interface.fake_values``: ``routing``,
    "uniform" or "all-to-one"), which the report says."""
    import torch.distributed as dist

    from . import fake_run
    from .engine import estimate
    from ..interface.estimates import meta_model

    assumptions = Assumptions(routing=routing)
    model_config = copy.deepcopy(model_config)  # the layout's stages set fields on it (an attention function's name)
    reason = refusal(parallel_config)
    if reason:
        raise ConfigError(reason)
    if dist.is_available() and dist.is_initialized():
        raise ConfigError("the dry run makes its own fake process group, and one is already initialized. Fix: call "
                          "us.dry_run before init_process_group, or in a process of its own")
    if micro_batch_size < 1 or seq_len < 1 or grad_accum < 1:
        raise ConfigError(f"micro_batch_size {micro_batch_size}, grad_accum {grad_accum}, seq_len {seq_len}: each must "
                          "be at least 1")
    fake_run.private_tools()
    if rank is not None and not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank}: not one of the {world_size} ranks")
    schedule, roles, apart = _roles(parallel_config, model_config, world_size, rank)
    micro_batches = schedule.microbatches if schedule.microbatches > 1 else grad_accum  # of one optimizer step
    start = time.perf_counter()
    if apart:  # each role traced by a dry run of its own rank, in a process of its own
        traced = _traced_apart(model_config, parallel_config, [role_rank for _, role_rank, _ in roles],
                               dict(world_size=world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                    grad_accum=grad_accum, max_grad_norm=max_grad_norm, lr=lr, routing=routing))
    else:
        split = (micro_batch_size, schedule.microbatches, grad_accum)
        traced = []
        for name, role_rank, coords in roles:
            est = estimate(parallel_config, model_config, world_size=world_size, seq_len=seq_len,
                           micro_batch=micro_batch_size, micro_batches=micro_batches, coords=coords,
                           model=meta_model(model_config))
            with fake_run.fake_process_group(role_rank, world_size), assuming(assumptions), \
                    warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*timeout is now only supported.*")  # the fake group's
                warnings.filterwarnings("ignore", message=".*module hierarchy tracking.*")  # MemTracker's, each step
                role = _run_role(model_config, parallel_config, role_rank, seq_len, split, max_grad_norm, lr)
            traced.append(dataclasses.replace(role, role=name, estimate_memory={**est.memory,
                                                                                "total": est.total_memory},
                                              estimate_comm=est.comm))
    return DryRunReport(roles=traced, world_size=world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                        layout=_label(parallel_config), seconds=time.perf_counter() - start,
                        assumed=assumptions.said(model_config), microbatches=micro_batches)


def _roles(parallel_config, model_config, world_size: int, rank: int | None) -> tuple:
    """The step's schedule (``ultrascale_cost_schedule``: its micro-batches, the mesh coordinates whose ranks can
    differ in cost) and the rank roles to trace, [(name, rank, coordinates)]: one per combination of the schedule's
    coordinates (the rank there, 0 along every other axis), or ``rank``'s alone; one, "every rank", when every
    rank plays the same role. The plugins say which ranks differ and in what words; the dry run names no family."""
    import itertools

    from .engine import registry_of, validate
    from ..interface.parallel_dims import ParallelDims
    from ..interface.step_schedule import StepSchedule

    pm, config = registry_of(parallel_config)
    resolved = validate(config, model_config, world_size, pm)
    schedule = pm.hook.ultrascale_cost_schedule(config=resolved) or StepSchedule()
    dims, axes = ParallelDims(resolved, world_size), schedule.coordinates
    if rank is not None:
        coords = {axis: dims.coordinate(rank, (axis,)) for axis in axes}
        return schedule, [(schedule.role(coords), rank, coords)], False
    strides, stride = {}, 1
    for axis in reversed(dims.live_axes):  # the mesh's order: the last axis varies fastest
        strides[axis.name], stride = stride, stride * axis.degree
    combos = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] or [{}]
    roles = [(schedule.role(c), sum(i * strides[a] for a, i in c.items()), c) for c in combos]
    # where another axis is live beside the roles' ones, a torch cache keyed by the mesh's shape hands one role's
    # process groups to the next role traced in the same process: then each role runs in a process of its own
    apart = len(roles) > 1 and any(a.name not in axes for a in dims.live_axes)
    return schedule, roles, apart


def _traced_apart(model_config, parallel_config, ranks: list, kwargs: dict) -> list:
    """The one role of ``dry_run(..., rank=r, **kwargs)`` for each of ``ranks``, each in a fresh process (spawned:
    no fake group, mesh or torch cache of this one), as many at once as there are cores."""
    import multiprocessing
    import os

    workers = max(1, min(len(ranks), os.cpu_count() or 1))
    # one role per process, never two in turn in one (maxtasksperchild): that is the cache this runs apart from
    with multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=1) as pool:
        return pool.starmap(_one_role, [(model_config, parallel_config, {**kwargs, "rank": r}) for r in ranks])


def _one_role(model_config, parallel_config, kwargs):
    return dry_run(model_config, parallel_config, **kwargs).roles[0]


def _label(config) -> str:
    """The fields of ``config`` away from their defaults, ``tp=2, sequence_parallel=True``."""
    defaults = type(config)(config.registry).to_dict()
    return ", ".join(f"{k}={v}" for k, v in config.to_dict().items() if defaults.get(k) != v) or "the defaults"


def _run_role(model_config, parallel_config, rank, seq_len, split, max_grad_norm, lr) -> RoleReport:
    """Parallelize a meta-device model over the fake group, then one warm-up and one tracked step; ``split``: (rows
    per micro-batch, micro-batches the model's own schedule runs inside it, micro-batches accumulated)."""
    from transformers import AutoModelForCausalLM

    from . import fake_run
    from .engine import place, registry_of, validate
    from ..distributed import launch
    from ..distributed.comm_ledger import CommLedger, GroupLabels

    _, FakeTensorMode, _, _ = fake_run.private_tools()
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the rotary buffers and the mesh's rank map stay real
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    # parallelize's path when a loader is given (checkpoints.load.parallelize, a layer above): validate, place
    pm, config = registry_of(parallel_config)
    resolved = validate(config, model.config, launch.world_size(), pm, model=model)
    pmodel = place(model, resolved, device=torch.device("cpu"), init_weights=fake_run.FakeWeights(fake), pm=pm)
    _complete_ddp_futures(pmodel)
    rows, inside, accumulated = split
    batch = {"input_ids": torch.randint(0, model_config.vocab_size, (rows * inside, seq_len))}
    with fake, fake_run.unpacked_rows(), fake_run.grouped_mm_in_any_dtype():
        opt = pmodel.build_optimizer(torch.optim.AdamW, lr=lr)
        _create_optimizer_states(pmodel, opt)
        tracker = fake_run.peak_tracker()
        inner = getattr(opt, "optim", None)  # ZeRO-1's ZeroRedundancyOptimizer keeps its states in its local one
        tracker.track_external(*pmodel.modules, opt, *([inner] if isinstance(inner, torch.optim.Optimizer) else []))
        held = dict(tracker.get_tracker_snapshot()[torch.device("cpu")])  # before the step: shards and states
        ledger = CommLedger(GroupLabels(lambda: [pmodel.dims.mesh, *pmodel.dims.view_meshes.values()]))
        with tracker, ledger:
            tracker.phase = "forward and backward (the loss)"
            _accumulate(pmodel, batch, 1 if pmodel.tokens.microbatches_inside > 1 else accumulated)
            tracker.phase = "gradient clipping"
            if max_grad_norm:
                pmodel.clip_grad_norm_(max_grad_norm)
            tracker.phase = "optimizer step"
            opt.step()
            opt.zero_grad()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    comm: dict = {}
    for record in ledger.records:
        comm[record.axis] = comm.get(record.axis, 0) + record.payload
    return RoleReport(role="every rank", rank=rank, peak=_by_name(peak), held=_by_name(held),
                      peak_where=tracker.peak_where, comm=comm, local_parameter_bytes=_local_bytes(pmodel))


def _accumulate(pmodel, batch: dict, micro_batches: int) -> None:
    """The forward and backward of one optimizer step, as the training loop runs ``micro_batches`` micro-batches
    of ``batch``'s rows each (``AccumulationWindow``: gradients kept local until the last); the dry run's rows are
    alike (no padding), so each weighs the same."""
    from .accumulation import AccumulationWindow

    window = AccumulationWindow.even(micro_batches)
    for i, weight in enumerate(window.weights):
        with window.sync(pmodel, i):
            pmodel.train_step(batch, loss_scale=weight)


def _by_name(snapshot: dict) -> dict:
    """MemTracker's snapshot {category enum: bytes} as {category name: bytes}."""
    return {getattr(k, "value", str(k)): int(v) for k, v in snapshot.items()}


def _create_optimizer_states(pmodel, opt) -> None:
    """One AdamW step on zero gradients: the optimizer's states exist, as after a first training step, without a
    forward and backward (``zero_grad`` then drops the gradients)."""
    for param in pmodel.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    opt.step()
    opt.zero_grad()


def _complete_ddp_futures(pmodel) -> None:
    """DDP's reducer waits on each bucket's future, and the fake group's work has none: a comm hook all-reduces
    the bucket on the same group (the ledger sees the same call) and completes the future itself."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(pmodel, "forward_module", None)
    if not isinstance(ddp, DistributedDataParallel):
        return

    def all_reduce(group, bucket):
        buffer = bucket.buffer()
        dist.all_reduce(buffer, group=group)
        future = torch.futures.Future()
        future.set_result(buffer.div_(dist.get_world_size(group)))
        return future

    ddp.register_comm_hook(ddp.process_group, all_reduce)


def _local_bytes(pmodel) -> int:
    """Bytes of the parameter shards this rank holds, as parallelize placed them."""
    from torch.distributed.tensor import DTensor

    locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in pmodel.parameters()]
    return sum(t.numel() * t.element_size() for t in locals_)

"""Data parallel: ZeRO-3 / ZeRO-2 / HSDP through FSDP2 ``fully_shard``, ZeRO-1 and plain replication through DDP
(plus ``ZeroRedundancyOptimizer`` for ZeRO-1), and mixed precision.

FSDP2 groups: one per decoder layer and one at the root. The root group holds the embedding, the final norm
and the head, so a tied embedding/head parameter lives in exactly one group (torch rejects a parameter shared
by two groups).
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..config import ConfigError
from ..hookspecs import hookimpl

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@hookimpl
def ultrascale_mesh_axes(config):
    return [("dp_replicate", config.dp_replicate), ("dp_shard", max(config.dp_shard, 1))]


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    if config.mixed_precision == "fp16":
        raise ConfigError("mixed_precision='fp16': fp16 needs a loss scaler over sharded gradients, which is not "
                          "available yet. Fix: use mixed_precision: bf16")


def uses_fsdp(ctx) -> bool:
    return ctx.config.zero_stage >= 2 and ctx.config.dp_shard > 1


@hookimpl
def ultrascale_transform_model(model, ctx, phase):
    if phase != "data_parallel":
        return
    cfg = ctx.config
    dtype = DTYPES.get(cfg.mixed_precision)
    if uses_fsdp(ctx):
        # HSDP when both data axes are >1: FSDP2 replicates over the first mesh dim and shards over the second.
        mesh = ctx.mesh[("dp_replicate", "dp_shard")] if cfg.dp_replicate > 1 else ctx.mesh["dp_shard"]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        # Inside a pipeline, layers stay unsharded between micro-batches (one all-gather per step, not per
        # micro-batch), as torchtitan does.
        reshard = cfg.zero_stage == 3 and cfg.pp == 1
        for fqn in ctx.plan_layers(model):
            fully_shard(model.get_submodule(fqn), mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        # The root's parameters are used first in backward, so keeping them unsharded after forward saves an
        # all-gather at no real memory cost.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        return
    if dtype is not None:
        ctx.autocast_dtype = dtype
    dp_mesh = ctx.sub_mesh("dp")
    if dp_mesh is None:
        return
    if cfg.pp > 1:
        # DDP's reducer miscounts parameters under the pipeline's per-micro-batch no_sync (torch 2.13: "rebuilt
        # parameter indices size is not same"), so pipeline stages average their gradients here after the
        # schedule's last backward instead.
        hooks = ctx.extras.setdefault("post_backward", [])
        if not any(getattr(h, "is_dp_allreduce", False) for h in hooks):
            hooks.append(_allreduce_hook(ctx, dp_mesh.get_group(), dp_mesh.size()))
        return
    ctx.materialize()  # DDP broadcasts rank 0's parameters when it wraps the model: they must exist
    ctx.forward_module = DistributedDataParallel(model, process_group=dp_mesh.get_group(),
                                                 device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def _allreduce_hook(ctx, group, size: int):
    def allreduce_grads() -> None:
        grads = [p.grad for m in ctx.modules for p in m.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    allreduce_grads.is_dp_allreduce = True
    return allreduce_grads


@hookimpl
def ultrascale_build_optimizer(pmodel, optimizer_cls, kwargs):
    ctx = pmodel.ctx
    if ctx.config.zero_stage != 1 or ctx.sub_mesh("dp") is None:
        return None
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(list(pmodel.parameters()), optimizer_class=optimizer_cls,
                                   process_group=ctx.sub_mesh("dp").get_group(), **kwargs)


@hookimpl
def ultrascale_estimate(config, model_config, estimate):
    from ..estimates import data_parallel_terms

    data_parallel_terms(config, model_config, estimate)


def partitioned(optimizer, group):
    """ZeRO-1 for an optimizer a user already built (front ends: Lightning's configure_optimizers, an
    Accelerate script): a ``ZeroRedundancyOptimizer`` of the same class and settings over ``group``."""
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer

    if len(optimizer.param_groups) != 1:
        raise ConfigError("zero_stage=1: an optimizer with several parameter groups cannot be partitioned. Fix: use "
                          "zero_stage: 2 or 3")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # defaults may hold derived keys
    return ZeroRedundancyOptimizer(optimizer.param_groups[0]["params"], optimizer_class=type(optimizer),
                                   process_group=group, **settings)


def move_scheduler(scheduler, old, new) -> None:
    """Point an LR scheduler built on ``old`` at ``new`` (its ``partitioned`` replacement), carrying the
    per-group learning rates the scheduler set up."""
    if getattr(scheduler, "optimizer", None) is not old:
        return
    for g_new, g_old in zip(new.param_groups, old.param_groups):
        for key in ("lr", "initial_lr"):
            if key in g_old:
                g_new[key] = g_old[key]
    scheduler.optimizer = new

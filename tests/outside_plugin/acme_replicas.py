"""A dimension plugin that lives outside ultrascale-plugins, as a third party would ship it: a second
data-parallel axis, ``acme_dp``, whose ranks split each data-parallel replica's rows between them.

It uses only the public hooks: a layout field, a mesh axis that averages gradients and counts loss tokens, the
batch split, a wrapper around the training step (counting steps), that count in checkpoints, and its
communication estimate; and two model transforms inserted among the built-in stages by name: ``acme_fused_norm``
(every RMSNorm computed by torch's fused ``rms_norm``, before tensor parallel so that sequence parallel wraps the
new forward) and ``acme_audit`` (after tensor parallel, before data parallel: it counts the parts TP had sharded
and FSDP had wrapped when it ran).
Installed by putting this directory on ``PYTHONPATH`` (the ``.dist-info`` beside it registers the module under
the ``ultrascale_plugins`` entry-point group).
"""
from __future__ import annotations

import re

from ultrascale_plugins import ConfigError, MeshAxis, Stage, hookimpl, step

STEPS = {"taken": 0}  # training steps this process has run (saved in checkpoints)
FUSED = {"norms": 0}  # RMSNorm modules this process computes with the fused kernel


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("acme_dp", int, 1, "acme's second data-parallel degree: its ranks split each replica's rows",
               minimum=1, ask="Acme's second data-parallel degree")
    fields.add("acme_fused_norm", bool, False, "compute every RMSNorm with torch's fused rms_norm")


def _norms(model):
    return [(fqn, m) for fqn, m in model.named_modules()
            if re.search(r"RMSNorm$", type(m).__name__) and getattr(m, "weight", None) is not None]


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if config.acme_fused_norm and not _norms(model):
        raise ConfigError("acme_fused_norm=True: the model has no RMSNorm. Fix: set acme_fused_norm: false")


@hookimpl
def ultrascale_transform_stages(config, model_config):
    # the fused norms before tensor parallel, so that sequence parallel wraps the new forward; the audit between
    # tensor parallel and data parallel (it sees the TP shards, not yet FSDP's)
    return [Stage("acme_fused_norm", fuse_norms, after=("split",), before=("tp",), active=config.acme_fused_norm,
                  does="every RMSNorm computed by torch's fused rms_norm"),
            Stage("acme_audit", audit, after=("tp",), before=("dp",), does="counts the TP-sharded model parts")]


def audit(model, ctx):
    """Counts, per parallelized model, the parts whose parameters tensor parallel had sharded when this ran, and
    those FSDP had already wrapped (none: it runs before data parallel)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) and not all(x.is_replicate() for x in p.placements)
                  for p in model.parameters())
    wrapped = any(isinstance(m, FSDPModule) for m in model.modules())
    seen = ctx.plugin_state.setdefault("acme_audit", {"tp_shards": 0, "fsdp": 0})
    seen["tp_shards"] += sharded
    seen["fsdp"] += wrapped


def fuse_norms(model, ctx):
    if not ctx.config.acme_fused_norm:
        return
    import torch

    for _, norm in _norms(model):
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))

        def fused(hidden_states, norm=norm, eps=eps):
            out = torch.nn.functional.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), eps=eps)
            return norm.weight * out.to(hidden_states.dtype)

        norm.forward = fused
        FUSED["norms"] += 1


@hookimpl
def ultrascale_declare_mesh_axes(config):
    # a data-parallel axis: inside each replica, outside the shards (and so outside tensor parallel)
    return [MeshAxis("acme_dp", config.acme_dp, after="dp_replicate", before="dp_shard", reduces_grads=True,
                     counts_tokens=True)]


@hookimpl
@step("acme_rows", after="tp", before="cp")  # its rows before context parallel reads the batch's documents
def ultrascale_step_shard_batch(batch, ctx):
    mesh = ctx.sub_mesh("acme_dp")
    if mesh is None:
        return
    rank, size = mesh.get_local_rank(), mesh.size()
    rows = batch["input_ids"].shape[0]
    if rows % size:
        raise ValueError(f"acme_dp={size}: a batch of {rows} rows does not split evenly")
    for key, value in batch.items():
        batch[key] = value[rank::size]


@hookimpl(wrapper=True)
def ultrascale_step_run(pmodel, batch, loss_scale):
    loss = yield
    STEPS["taken"] += 1
    return loss


@hookimpl
def ultrascale_state_save(pmodel, state):
    state.shared["acme_steps"] = STEPS["taken"]
    state.shared["acme_fused_norms"] = FUSED["norms"]
    seen = pmodel.ctx.plugin_state.get("acme_audit", {})
    state.shared["acme_saw_tp_shards"] = seen.get("tp_shards", 0)
    state.shared["acme_saw_fsdp"] = seen.get("fsdp", 0)


@hookimpl
def ultrascale_state_load(pmodel, state):
    STEPS["taken"] = state.shared.get("acme_steps", 0)


@hookimpl
@step("acme_grads", after="dp")  # after data parallel: this rank's gradient bytes are known
def ultrascale_cost_estimate(config, model_config, shape, estimate):
    if config.acme_dp > 1:  # one all-reduce of the gradients per step
        estimate.add_comm("acme_dp", estimate.memory["grads"], "all_reduce")

"""A dimension plugin that lives outside ultrascale-plugins, as a third party would ship it: a second
data-parallel axis, ``acme_dp``, whose ranks split each data-parallel replica's rows between them.

It uses only the public hooks: a layout field, a mesh axis that averages gradients and counts loss tokens, the
batch split, a wrapper around the training step (counting steps), that count in checkpoints, and its
communication estimate; and a model transform (``acme_fused_norm``: every RMSNorm computed by torch's fused
``rms_norm``, placed before tensor parallel so that sequence parallel wraps the new forward). Installed by putting this directory on ``PYTHONPATH`` (the ``.dist-info`` beside it
registers the module under the ``ultrascale_plugins`` entry-point group).
"""
from __future__ import annotations

import re

from ultrascale_plugins import ConfigError, MeshAxis, hookimpl, position

STEPS = {"taken": 0}  # training steps this process has run (saved in checkpoints)
FUSED = {"norms": 0}  # RMSNorm modules this process computes with the fused kernel


@hookimpl
def ultrascale_add_fields(fields):
    fields.add("acme_dp", int, 1, "acme's second data-parallel degree: its ranks split each replica's rows",
               minimum=1)
    fields.add("acme_fused_norm", bool, False, "compute every RMSNorm with torch's fused rms_norm")


def _norms(model):
    return [(fqn, m) for fqn, m in model.named_modules()
            if re.search(r"RMSNorm$", type(m).__name__) and getattr(m, "weight", None) is not None]


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if config.acme_fused_norm and not _norms(model):
        raise ConfigError("acme_fused_norm=True: the model has no RMSNorm. Fix: set acme_fused_norm: false")


@hookimpl
@position(1550)  # before tensor parallel (1600): sequence parallel then wraps the fused forward
def ultrascale_shard_model(model, ctx):
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
def ultrascale_mesh_axes(config):
    # between dp_replicate (20) and dp_shard (30): a data-parallel axis, outside tensor parallel
    return [MeshAxis("acme_dp", config.acme_dp, order=25, reduces_grads=True, counts_tokens=True)]


@hookimpl
def ultrascale_shard_batch(batch, ctx):
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
def ultrascale_train_step(pmodel, batch, loss_scale):
    loss = yield
    STEPS["taken"] += 1
    return loss


@hookimpl
def ultrascale_state_dict(pmodel, state):
    state.shared["acme_steps"] = STEPS["taken"]
    state.shared["acme_fused_norms"] = FUSED["norms"]


@hookimpl
def ultrascale_load_state_dict(pmodel, state):
    STEPS["taken"] = state.shared.get("acme_steps", 0)


@hookimpl(wrapper=True)
def ultrascale_estimate(config, model_config, shape, estimate):
    result = yield  # after the built-in dimensions: this rank's gradient bytes are known
    if config.acme_dp > 1:  # one all-reduce of the gradients per step
        estimate.add_comm("acme_dp", estimate.memory["grads"], "all_reduce")
    return result

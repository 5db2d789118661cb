"""A dimension plugin that lives outside ultrascale-plugins, as a third party would ship it: a second
data-parallel axis, ``acme_dp``, whose ranks split each data-parallel replica's rows between them.

It uses only the public hooks: a layout field, a mesh axis that averages gradients and counts loss tokens, the
batch split, a wrapper around the training step (counting steps), that count in checkpoints, and its
communication estimate. Installed by putting this directory on ``PYTHONPATH`` (the ``.dist-info`` beside it
registers the module under the ``ultrascale_plugins`` entry-point group).
"""
from __future__ import annotations

from ultrascale_plugins import MeshAxis, hookimpl

STEPS = {"taken": 0}  # training steps this process has run (saved in checkpoints)


@hookimpl
def ultrascale_add_fields(fields):
    fields.add("acme_dp", int, 1, "acme's second data-parallel degree: its ranks split each replica's rows",
               minimum=1)


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


@hookimpl
def ultrascale_load_state_dict(pmodel, state):
    STEPS["taken"] = state.shared.get("acme_steps", 0)


@hookimpl(wrapper=True)
def ultrascale_estimate(config, model_config, shape, estimate):
    result = yield  # after the built-in dimensions: this rank's gradient bytes are known
    if config.acme_dp > 1:  # one all-reduce of the gradients per step
        estimate.add_comm("acme_dp", estimate.memory["grads"], "all_reduce")
    return result

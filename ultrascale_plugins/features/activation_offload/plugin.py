"""Activation offload (``activation_offload: true``): each decoder layer's forward runs under saved-tensor hooks
that hold what it saves for its backward in host memory (``offloader.HostOffload``). With full recomputation
(``activation_checkpointing: full``) a layer saves only its inputs, which are what moves; without recomputation
every activation the layer saves does, so the device holds about one layer's at a time.

The layer's ``forward`` is wrapped in place (after recomputation wrapped it), as recomputation does, so parameter
names stay the model's. Not with ``compile``: the compiled layers' saved tensors are not the eager ones these hooks
see.
"""
from __future__ import annotations

import functools

import torch

from ...interface.config import field_error
from ...interface.facts import layout_facts
from ...interface.hookspecs import hookimpl
from ...interface.stages import Stage
from .offloader import HostOffload, parameter_storages


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("activation_offload", bool, False, "hold what each decoder layer saves for its backward in host "
               "memory between its forward and its backward (copied out on a side stream on a GPU); with "
               "activation_checkpointing: full, the layers' inputs",
               dry_run="the dry run holds every tensor in one memory, so host and device are one")
    # the facts this plugin decides for the others (answered in ultrascale_declare_facts), with their defaults
    fields.fact("activations_offloaded", False, "what the decoder layers save for their backward is held in host "
                                                "memory")


@hookimpl
def ultrascale_declare_facts(config, degrees):
    return {"activations_offloaded": bool(config.activation_offload)}


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    compiled = layout_facts(config).compiled
    if config.activation_offload and compiled != "none":
        raise field_error("activation_offload", True, f"compile={compiled} compiles each layer, whose saved "
                          "tensors are not the ones the offload hooks see", "use compile: none with it, or "
                          "activation_offload: false")


@hookimpl
def ultrascale_transform_stages(config, model_config):
    return [Stage("activation_offload", offload_layers, after=("ac",), before=("compile", "dp"),
                  active=bool(config.activation_offload),
                  does="what each decoder layer saves for its backward is held in host memory")]


def offload_layers(model, ctx):
    hooks = ctx.plugin_state.setdefault("activation_offload", HostOffload())
    for fqn in ctx.plan_layers(model):
        _wrap(model.get_submodule(fqn), hooks)


def _wrap(module: torch.nn.Module, hooks: HostOffload) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        hooks.keep = parameter_storages(module)  # gathered by now (FSDP2's pre-forward hook ran)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            return inner(*args, **kwargs)

    module.forward = forward

"""What a parallelism dimension is: the pluggy hook specifications.

Every built-in dimension (ZeRO, tensor/sequence parallel, activation checkpointing, the default training step,
the GPT-2 plan) implements these hooks exactly as a third-party plugin would. Hook names start with
``ultrascale_``; an implementation whose name matches no specification is rejected when plugins load.
"""
from __future__ import annotations

import pluggy

PROJECT = "ultrascale_plugins"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# The order in which model transforms run (torchtitan's composition order). The engine calls
# ``ultrascale_transform_model`` once per phase, in this order.
TRANSFORM_PHASES = ("pipeline", "tensor", "context", "activation_checkpointing", "compile", "data_parallel")


@hookspec
def ultrascale_mesh_axes(config):
    """Return ``[(axis_name, degree), ...]`` for the device-mesh axes this dimension needs (degree 1 allowed).

    An axis nobody declares cannot be used: asking for ``pp=2`` with no plugin declaring ``"pp"`` is a
    ConfigError that says the dimension is not available.
    """


@hookspec
def ultrascale_validate_config(config, model_config, world_size):
    """Raise ``ConfigError`` when this dimension's part of ``config`` cannot run (before any process group)."""


@hookspec
def ultrascale_validate_model(model, plan, config):
    """Raise ``ConfigError`` when this dimension cannot run on this model's structure. Called before any process
    group exists; ``model`` may live on the meta device, ``plan`` is the model plan (or None)."""


@hookspec(firstresult=True)
def ultrascale_model_plan(model, config):
    """Return a ``ModelPlan`` for this Hugging Face model, or None to let another plugin answer."""


@hookspec
def ultrascale_transform_model(model, ctx, phase):
    """Transform ``model`` in place for ``phase`` (one of TRANSFORM_PHASES). ``ctx`` is the ParallelContext
    (config, mesh, plan); act only on the phases that concern this dimension."""


@hookspec(firstresult=True)
def ultrascale_build_optimizer(pmodel, optimizer_cls, kwargs):
    """Return an optimizer over ``pmodel``'s parameters, or None for the plain ``optimizer_cls``."""


@hookspec(firstresult=True)
def ultrascale_train_step(pmodel, batch, loss_scale):
    """Run forward and backward on this rank's batch and return the global-mean loss (a 0-d tensor, the same on
    every rank). Gradients are those of ``loss_scale`` times that loss (front ends pass 1/k under gradient
    accumulation). First result wins: the built-in data/tensor-parallel step is registered last."""


@hookspec
def ultrascale_estimate(config, model_config, estimate):
    """Add this dimension's memory (bytes per rank) and communication (bytes per rank per step) terms to the
    ``estimate`` dict, in place, under keys of your choosing."""


@hookspec
def ultrascale_state_dict(pmodel, state):
    """Add entries to ``state`` (a dict being saved) that this dimension owns."""


@hookspec
def ultrascale_load_state_dict(pmodel, state):
    """Restore this dimension's entries from ``state``."""

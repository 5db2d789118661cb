"""Regional compilation: ``torch.compile`` of each decoder layer (``compile: regional``), as torchtitan does.

Why per layer and not the whole model: a whole-model graph breaks at every collective the layouts put between
layers (FSDP2's all-gathers run in module hooks, a pipeline's sends between stages), while each decoder layer's
compute is one graph; and the layers of one class share their compiled code, so compile time is that of one
layer (plus a graph per layer variant: sliding versus full attention), not of the model.

What is compiled is the layer's ``forward`` as the other transforms left it (stage ``compile``, after ``ac``): inside it tensor
parallel's sharded matmuls and activation checkpointing (compiled with the layer, so selective recomputation's
policy is traced too); outside it FSDP2's hooks (they run on ``__call__``, around ``forward``), so parameter
names and checkpoints are those of the eager model. Context parallel's attention runs eagerly inside the
compiled layer (its ring sends cannot be traced; ``cp_attention`` is excluded from compilation).
"""
from __future__ import annotations

import functools

import torch
import torch._dynamo

from ...interface.config import field_error
from ...interface.facts import layout_facts
from ...interface.hookspecs import hookimpl
from ...interface.stages import Stage

MODES = ("none", "regional")


@hookimpl
def ultrascale_declare_facts(config, degrees):
    return {"compiled": config.compile}


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("compile", str, "none", "regional: torch.compile each decoder layer (inductor), composed with every "
               "layout", choices=MODES, dry_run="inductor's kernels hold memory the tracker does not see")
    # the facts this plugin decides for the others (answered in ultrascale_declare_facts), with their defaults
    fields.fact("compiled", "none", "how the decoder layers are compiled: regional (each by torch.compile) or none")


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    facts = layout_facts(config)
    if config.compile != "none" and facts.recompute == "full" and facts.degree("tp") > 1:
        # torch 2.13 fails in the first backward: a compiled, fully recomputed region saves tensor parallel's
        # device mesh among the tensors it keeps ("expected all tensors_saved_with_vc_check to be Tensors")
        raise field_error("compile", config.compile, "torch cannot compile a fully recomputed layer that holds "
                          f"tensor-parallel shards (activation_checkpointing=full, tp={facts.degree('tp')})",
                          "use activation_checkpointing: selective (it compiles with tp), or compile: none")


@hookimpl
def ultrascale_transform_stages(config, model_config):
    return [Stage("compile", compile_layers, after=("ac",), active=config.compile != "none",
                  does="each decoder layer compiled (torch.compile), with what the stages before put inside it")]


def compile_layers(model, ctx):
    """Last among the per-layer wrappers: the compiled region holds activation checkpointing, not the reverse."""
    if ctx.config.compile == "none":
        return
    if ctx.dims.facts.recompute != "none":
        # A forward that sets and resets state outside the layer (transformers' hub-kernel wrappers set a context
        # variable around attention) is refused inside a compiled checkpoint, which would not replay it while
        # recomputing, and the whole layer falls back to eager. The recomputation needs no such state: the
        # forward sets it and restores it before returning.
        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # torch >= 2.12
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for fqn in ctx.plan_layers(model):
        compile_layer(model.get_submodule(fqn))


def compile_layer(layer: torch.nn.Module) -> None:
    """Replace ``layer.forward`` by its compiled self. Without an instance wrapper the compiled function is the
    class's ``forward``, shared by every layer of the class, with the layer as an argument: layers of one class
    then reuse one graph (a function bound to its layer is traced once per layer, each guarded on the layer's
    identity). A wrapper another transform installed (activation checkpointing, tensor parallel's local views)
    closes over its own layer's state, so it is compiled as it is, per layer."""
    inner = layer.__dict__.get("forward")
    if inner is not None:
        layer.forward = torch.compile(inner)
        return
    layer.forward = functools.partial(_shared(type(layer).forward), layer)


@functools.lru_cache(maxsize=None)
def _shared(function):
    return torch.compile(function)

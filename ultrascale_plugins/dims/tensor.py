"""Tensor parallel and Megatron-style sequence parallel, on the ``tp`` axis, driven by the model plan.

Sequence parallel keeps the residual stream sharded over the sequence between TP regions: norms (and the
dropout after them) run on ``S/tp`` tokens, each region all-gathers its input and reduce-scatters its output.
The embedding and the model's mask/position computation stay on the full sequence; the first decoder layer
takes its shard (a local slice, no communication), and the head all-gathers before the vocabulary projection.
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from ..config import ConfigError
from ..hookspecs import hookimpl
from .tp_styles import make_style, redistribute_first_input


@hookimpl
def ultrascale_mesh_axes(config):
    return [("tp", config.tp)]


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    if config.tp > 1 and config.zero_stage in (0, 1) and config.dp_replicate * max(config.dp_shard, 1) > 1:
        raise ConfigError(
            f"zero_stage={config.zero_stage} with tp={config.tp}: replicated data parallel over tensor-parallel "
            "(DTensor) parameters is not available. Fix: use zero_stage: 2 or 3 (FSDP2 composes with TP)")


@hookimpl
def ultrascale_transform_model(model, ctx, phase):
    if phase != "tensor" or ctx.config.tp == 1:
        return
    plan = ctx.plan
    if plan is None:
        raise ConfigError(
            f"tp={ctx.config.tp}: model type '{getattr(model.config, 'model_type', type(model).__name__)}' has no "
            "tensor-parallel plan. Fix: use tp: 1, or register a plugin whose ultrascale_model_plan returns one")
    mesh = ctx.sub_mesh("tp")
    sp = ctx.config.sequence_parallel
    styles = {fqn: make_style(name, sequence_parallel=sp, loss_parallel=ctx.config.loss_parallel,
                              is_head=(fqn == plan.lm_head), extra=plan.styles)
              for fqn, name in plan.matches(model).items()}
    if sp:
        for norm in plan.norms:
            styles.setdefault(norm, SequenceParallel())
    parallelize_module(model, mesh, styles)
    if sp:
        for region in plan.regions:
            model.get_submodule(region).register_forward_pre_hook(
                redistribute_first_input(mesh, Shard(1), Replicate()), with_kwargs=True)
        if plan.layers:
            model.get_submodule(plan.layers[0]).register_forward_pre_hook(
                redistribute_first_input(mesh, Replicate(), Shard(1)), with_kwargs=True)
    if plan.tied and plan.embedding and plan.lm_head:
        # parallelize_module gives each module a fresh Parameter; tie the head back to the embedding's.
        embed, head = model.get_submodule(plan.embedding), model.get_submodule(plan.lm_head)
        if head.weight is embed.weight:
            return
        if getattr(embed.weight, "placements", None) != getattr(head.weight, "placements", None):
            raise ConfigError(f"tied embedding '{plan.embedding}' and head '{plan.lm_head}' got different TP "
                              "placements. Fix: shard both by vocabulary rows, or neither, in the plan")
        head.weight = embed.weight


@hookimpl
def ultrascale_estimate(config, model_config, estimate):
    from ..estimates import tensor_parallel_terms

    tensor_parallel_terms(config, model_config, estimate.get("seq_len", 2048), estimate.get("micro_batch", 1),
                          estimate)

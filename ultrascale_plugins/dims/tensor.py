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
from .pipeline_split import Absent
from .tp_styles import make_style, redistribute_first_input, redistribute_output


@hookimpl
def ultrascale_mesh_axes(config):
    return [("tp", config.tp)]


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    dp = config.dp_replicate * max(config.dp_shard, 1)
    if config.tp > 1 and dp > 1 and not (config.zero_stage >= 2 and config.dp_shard > 1):
        raise ConfigError(
            f"zero_stage={config.zero_stage}, dp_shard={config.dp_shard} with tp={config.tp}: replicated data "
            "parallel (DDP) over tensor-parallel (DTensor) parameters is not available. Fix: use zero_stage: 2 or "
            "3 with dp_shard >= 2 (FSDP2 composes with TP; add dp_replicate for HSDP)")


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
    present = {fqn for fqn, m in model.named_modules() if not isinstance(m, Absent)}
    styles = {fqn: make_style(name, sequence_parallel=sp, loss_parallel=ctx.config.loss_parallel,
                              is_head=(fqn == plan.lm_head), extra=plan.styles)
              for fqn, name in plan.matches(model).items() if fqn in present}
    if sp:
        for norm in plan.norms:
            if norm in present:
                styles.setdefault(norm, SequenceParallel())
    parallelize_module(model, mesh, styles)
    if sp:
        for region in plan.regions:
            if region in present:
                model.get_submodule(region).register_forward_pre_hook(
                    redistribute_first_input(mesh, Shard(1), Replicate()), with_kwargs=True)
        layers = ctx.plan_layers(model)
        if layers:
            # the sequence is split where the (stage's) layers start and, on a pipeline stage that hands its
            # hidden states on, gathered again where they end: every stage sees the full sequence, so the
            # model builds its masks and positions as usual
            model.get_submodule(layers[0]).register_forward_pre_hook(
                redistribute_first_input(mesh, Replicate(), Shard(1)), with_kwargs=True)
            if plan.lm_head is not None and plan.lm_head not in present:
                model.get_submodule(layers[-1]).register_forward_hook(
                    redistribute_output(mesh, Shard(1), Replicate()))
    if plan.tied and plan.embedding in present and plan.lm_head in present:
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

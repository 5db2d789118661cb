"""Pipeline parallel for unmodified Hugging Face decoders, on the ``pp`` axis, through
``torch.distributed.pipelining`` schedules.

Splitting: every stage is a copy of the causal LM in which the modules other stages own are replaced by
``Absent`` placeholders (no parameters, hidden states pass through). Layers keep their index in the
``ModuleList``, so parameter names (FQNs) are those of the unsplit model and a checkpoint from one layout loads in
another. Each stage runs the model's own forward — embeddings (first stage), rotary embeddings, causal and padding
masks, position ids (every stage, on the full sequence), norm and head (last stage) — so nothing about the
architecture is re-implemented here. The padding mask and the position ids travel with the hidden states from
stage to stage.

Loss: the last stage computes the model's causal-LM loss per micro-batch as a sum over valid tokens scaled by
``dp / global_valid_tokens`` (schedules' own 1/m scaling is off), so the gradient is that of the global-mean loss
whatever the micro-batches hold. Tied embeddings: the first stage's embedding and the last stage's head are
separate copies; after backward their gradients are summed, so they stay equal.
"""
from __future__ import annotations

from ...interface.config import ConfigError
from ...interface.facts import layout_facts
from ...interface.hookspecs import hookimpl
from ...interface.mesh_axes import MeshAxis
from ...interface.stages import Stage, step
from .runtime import Pipeline
from .split import (
    LOOPED, SINGLE_STAGE, SPLIT_BACKWARD, V_SHAPED, _base, build_stage, microbatches, pp_parts, pp_rank_of_stage,
    split_layers, stage_ids_for_rank, stage_layer_counts, stages_per_rank,
)
from .timeline import PipelineSchedule

SCHEDULES = (*SINGLE_STAGE, *LOOPED, *V_SHAPED)


def _split(value):
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return "must be a list of layer counts per stage", "write e.g. pp_split: [3, 5], or leave it out"
    return None


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("pp", int, 1, "pipeline-parallel degree (the outermost mesh axis)", minimum=1,
               ask="Pipeline-parallel degree")
    fields.add("pp_schedule", str, "1f1b", "pipeline schedule", choices=SCHEDULES,
               ask="Pipeline schedule", ask_when=lambda said: said.get("pp", 1) > 1, dry_run=_schedule_not_dry_run)
    fields.add("pp_microbatches", int, 0, "micro-batches per step; 0 = as many as pipeline stages", minimum=0)
    fields.add("pp_virtual_stages", int, 1, "stages per rank (looped schedules: 2 or more; V schedules: 2)",
               minimum=1)
    fields.add("pp_split", list, None, "layers per pipeline stage, e.g. [3, 5]; unset = balanced automatically",
               optional=True, check=_split)


def _schedule_not_dry_run(config) -> str:
    """Why the dry run does not run this schedule yet ("" where it does): those that split the backward (torch's
    MemTracker hooks every gradient, which their ``autograd.grad`` over the stage's inputs refuses)."""
    if config.pp > 1 and config.pp_schedule in SPLIT_BACKWARD:
        return "its split backward's autograd.grad refuses the memory tracker's gradient hooks; 1f1b, gpipe and " \
               "interleaved_1f1b run"
    return ""


@hookimpl
def ultrascale_declare_mesh_axes(config):
    stages = f", {config.pp_virtual_stages} stages/rank" if config.pp_virtual_stages > 1 else ""
    # outermost (stages talk least often): the other axes lie after it
    return [MeshAxis("pp", config.pp, words=f"({config.pp_schedule}{stages})",
                     says=("pp_schedule", "pp_virtual_stages"))]


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    if config.pp == 1:
        return
    v, m = stages_per_rank(config), microbatches(config)
    n_stages = config.pp * v
    layers = getattr(model_config, "num_hidden_layers", None)
    if layers is not None and config.pp > layers:
        raise ConfigError(f"pp={config.pp}: is larger than num_hidden_layers={layers}. Fix: use pp <= {layers}")
    name = config.pp_schedule
    if name in SINGLE_STAGE and config.pp_virtual_stages != 1:
        raise ConfigError(f"pp_virtual_stages={config.pp_virtual_stages}: schedule '{name}' runs one stage per "
                          "rank. Fix: use pp_virtual_stages: 1, or pp_schedule: interleaved_1f1b")
    if name in LOOPED and v < 2:
        raise ConfigError(f"pp_schedule='{name}' needs pp_virtual_stages >= 2 (stages per rank). Fix: set "
                          "pp_virtual_stages: 2")
    if name in V_SHAPED and config.pp_virtual_stages not in (1, 2):
        raise ConfigError(f"pp_virtual_stages={config.pp_virtual_stages}: '{name}' places exactly 2 stages per "
                          "rank in a V. Fix: use pp_virtual_stages: 2")
    if layers is not None and n_stages > layers:
        raise ConfigError(f"pp={config.pp} x {v} stages per rank = {n_stages} stages but the model has "
                          f"num_hidden_layers={layers}. Fix: use fewer stages")
    if config.pp_split:
        if (len(config.pp_split) != n_stages or min(config.pp_split) < 1
                or (layers is not None and sum(config.pp_split) != layers)):
            raise ConfigError(f"pp_split={config.pp_split}: needs {n_stages} positive layer counts summing to "
                              f"num_hidden_layers={layers}. Fix: e.g. pp_split: {split_layers(layers, n_stages)}")
    if name in ("1f1b",) and m < config.pp:
        raise ConfigError(f"pp_microbatches={m}: 1f1b needs at least pp={config.pp} micro-batches. Fix: set "
                          f"pp_microbatches: {config.pp} or more")
    if name in LOOPED and m % config.pp:
        raise ConfigError(f"pp_microbatches={m}: '{name}' needs a multiple of pp={config.pp}. Fix: set "
                          f"pp_microbatches: {config.pp * max(1, m // config.pp)}")
    if name in SPLIT_BACKWARD and layout_facts(config).grad_reduce == "micro_batch":
        raise ConfigError(f"grad_sync='micro_batch' with pp_schedule='{name}': the schedule computes a micro-batch's "
                          "weight gradients apart from its backward, so FSDP2 would reduce them before they are "
                          "complete. Fix: use grad_sync: step, or pp_schedule: 1f1b, gpipe or interleaved_1f1b")
    if name in V_SHAPED and m < 2 * config.pp:
        raise ConfigError(f"pp_microbatches={m}: '{name}' needs at least 2*pp={2 * config.pp} micro-batches. "
                          f"Fix: set pp_microbatches: {2 * config.pp}")


def _root(plan) -> str:
    """Where the causal LM sits in the model handed to ``parallelize`` ("" unless a wrapper holds it: PEFT's)."""
    return plan.root if plan is not None else ""


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if config.pp > 1:
        root = _root(plan)
        lm = model.get_submodule(root) if root else model
        pp_parts(lm)  # a ConfigError naming the architecture when it has no usable pipeline plan
        _dry_split(model, config, root)
        extra = _layer_state(lm)  # the causal LM itself: a wrapper's adapters do not change what layers return
        if extra:
            raise ConfigError(
                f"pp={config.pp}: the decoder layers of model type '{lm.config.model_type}' hand the next layer "
                f"state besides the hidden states ({extra}), which pipeline stages do not send. Fix: use pp: 1 for "
                "this model")


def _layer_state(lm) -> str | None:
    """What a decoder layer returns besides the hidden states (GLM-MoE-DSA hands on its indexer's top-k), from
    one run of a meta-device twin; None when it returns the hidden states alone (or cannot run on meta)."""
    import torch

    from ...models.dataflow import meta_inputs, meta_twin

    lm = meta_twin(lm)
    _, layers_name, _ = pp_parts(lm)
    seen: list = []
    hook = getattr(_base(lm), layers_name)[0].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            lm(**meta_inputs(8))
    except Exception:  # noqa: BLE001 - a model that cannot run on meta shows its own error when it runs
        return None
    finally:
        hook.remove()
    out = seen[0] if seen else None
    if isinstance(out, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in out[1:]):
        return f"a {type(out).__name__} of {len(out)}"
    return None


@hookimpl
def ultrascale_transform_stages(config, model_config):
    return [Stage("split", split_model, axes=("pp",), active=config.pp > 1, splits=True,
                  does=f"the layers cut into {config.pp * config.pp_virtual_stages} pipeline stages, "
                       f"{config.pp_virtual_stages} per rank, run by the {config.pp_schedule} schedule")]


def split_model(model, ctx):
    """This rank's pipeline stages of ``model`` and the ``Pipeline`` runtime that schedules them."""
    if not ctx.dims.enabled("pp"):
        return None
    cfg, root = ctx.config, _root(ctx.plan)
    lm = model.get_submodule(root) if root else model
    _, layers_name, _ = pp_parts(lm)
    pp_rank = ctx.sub_mesh("pp").get_local_rank()
    ranges = stage_ranges(cfg, len(getattr(_base(lm), layers_name)))
    ids = stage_ids_for_rank(cfg, pp_rank)
    stages = [build_stage(model, s, len(ranges), ranges[s], root) for s in ids]
    return stages, Pipeline(ctx, stages, ids, len(ranges))


def stage_ranges(config, n_layers: int) -> list[range]:
    """The decoder layers of each pipeline stage, in stage order."""
    counts = stage_layer_counts(config, n_layers)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(starts[s], starts[s] + counts[s]) for s in range(len(counts))]


def _dry_split(model, config, root: str = "") -> None:
    """Build every stage as ``split_model`` does, from a meta-device twin, so a model that cannot be
    split is refused before launch rather than in every worker."""
    from ...models.dataflow import meta_twin

    twin = meta_twin(model)
    lm = twin.get_submodule(root) if root else twin
    _, layers_name, _ = pp_parts(lm)
    ranges = stage_ranges(config, len(getattr(_base(lm), layers_name)))
    for s, layers in enumerate(ranges):
        try:
            build_stage(twin, s, len(ranges), layers, root)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's module tree does not split the way the plan says
            raise ConfigError(
                f"pp={config.pp}: model type '{lm.config.model_type}' could not be split into {len(ranges)} "
                f"pipeline stages (stage {s}, layers {layers.start}-{layers.stop - 1}, tried on the meta device: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}). Fix: use pp: 1 "
                "for this model") from exc


def _pp_layout(world, per_node, model_config):
    nodes = max(1, world // per_node)
    pp = nodes if nodes > 1 else min(2, world)
    if world % pp:
        raise ConfigError(f"strategy 'ultrascale_pp': {world} devices do not split into {pp} pipeline stages. "
                          "Fix: use an even number of devices")
    return {"pp": pp, "dp_shard": world // pp, "pp_schedule": "1f1b"}


@hookimpl
@step("split")
def ultrascale_cost_estimate(config, model_config, shape, estimate):
    """At the split, before the other dimensions: the rank's stages decide which parameters and layers they cost."""
    from .costs import pipeline_terms

    pipeline_terms(config, shape, estimate)


@hookimpl
def ultrascale_cost_comm_minimum(config, shape):
    """The least communication the pipeline's ``pp`` axis needs for a step (``minimum``)."""
    from .minimum import pipeline_minimum

    return pipeline_minimum(config, shape)


@hookimpl
def ultrascale_cost_schedule(config):
    """With pp > 1: the schedule's micro-batches, its timeline, and the pipeline ranks that can be the most loaded:
    the first two (the embedding, the most micro-batches in flight; the second may hold one layer more) and the ones
    holding the last stage (head, logits)."""
    pp = config.pp
    if pp == 1:
        return None
    last = pp_rank_of_stage(config, pp * stages_per_rank(config) - 1)
    ranks = sorted({0, min(1, pp - 1), pp - 1, last})
    return PipelineSchedule(microbatches(config), {"pp": ranks}, schedule=config.pp_schedule, stages=pp,
                            virtual_stages=config.pp_virtual_stages,
                            holds={r: tuple(stage_ids_for_rank(config, r)) for r in ranks})


@hookimpl
def ultrascale_declare_presets():
    from ...interface.presets import Preset

    return [Preset("pp", "pipeline parallel across nodes (2 stages on one node), 1F1B, ZeRO-3 over the rest",
                   _pp_layout)]

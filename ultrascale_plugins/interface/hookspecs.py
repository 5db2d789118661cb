"""What a parallelism dimension is: the pluggy hook specifications, in six groups.

Every built-in dimension and feature (data parallel / ZeRO, tensor and sequence parallel, pipeline, context and
expert parallel, PEFT, routers, float8, compile, activation checkpointing, the training step, the model plans)
implements these hooks exactly as a third-party plugin registered under the ``ultrascale_plugins`` entry point
would. Hook names are ``ultrascale_<group>_<what>`` (pytest's pattern: the group first); an implementation whose
name matches no specification is rejected when plugins load. ``GROUPS`` lists them by what they are for, in the
order the engine asks:

- **declare**: the plugin's layout fields and mesh axes, the facts it decides for other families to read, the
  model plans it knows (and its additions to other plugins' plans), a library of model wrappers it owns (PEFT's:
  ``model_wrapper.WrapperLibrary``, which sees through its models, prices its adapters and exports its checkpoints),
  the names front ends offer (Lightning strategies, Accelerate keys);
- **validate**: before any process group, the layout chosen when asked (``layout: auto``), then checked against the
  world size, the model's config and its structure, and the training loop a front end runs;
- **transform**: its model transforms as named stages, each declaring which stages it runs after and before
  (``interface.stages`` orders them);
- **step**: its part of every step: the batch, the optimizer, the loss (how it is computed, what is added to it),
  gradient accumulation, what follows the last backward, the step itself (replace it, or wrap it with a
  ``@hookimpl(wrapper=True)`` generator);
- **state**: its entries in checkpoints, tensors placed in pieces DCP cannot describe;
- **cost**: its per-rank costs, the least communication its axes need, the values the planner's search should try,
  how a step runs its micro-batches (how many, the ranks worth costing, the timeline the plot draws).

A family's own runtime needs are methods of its own objects, not hooks: a pipeline's schedule is its
``interface.runtime.Runtime`` subclass, PEFT's names and initialization its ``ModelWrapper``, its pricing and exports
its ``WrapperLibrary``.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import pluggy

# The types a hook speaks, imported for type checkers only: importing the hookspecs stays cheap and closes no import
# loop with the modules that define those types. The engine's objects (the context, the parallel model, plugin
# state, a saved checkpoint, the model plan) live above this layer: ``protocols`` says what each offers a plugin.
# tests/test_hookspecs.py resolves every hookspec's annotations against these imports.
if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from .comm_minimum import MinimumTerm
    from .config import ParallelConfig
    from .estimates import Estimate, Shape
    from .fields import Fields
    from .loss_part import LossPart
    from .mesh_axes import MeshAxis, MeshView
    from .model_wrapper import WrapperLibrary
    from .plan_edit import PlanEdit
    from .presets import Preset
    from .protocols import ModelPlan, ParallelContext, ParallelModel, PluginState
    from .recipe_section import RecipeSection
    from .search_offer import SearchOffer
    from .stages import Stage
    from .step_schedule import StepSchedule
    from .training_loop import TrainingLoop

PROJECT = "ultrascale_plugins"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---- declare ---------------------------------------------------------------------------------------------------------
# What the plugin adds: its layout fields and mesh axes, the model plans it knows, a wrapper it owns, the names
# front ends offer.
@hookspec
def ultrascale_declare_fields(fields: Fields) -> None:
    """Declare this dimension's layout fields, and the facts it decides for the others. The fields become valid
    everywhere a layout is written; each fact is answered per layout in ``ultrascale_declare_facts``.

    Called for each plugin in registration order (by the registry, ``core.registry``); each field and fact is
    recorded with its plugin.

    :param fields: The ``fields.Fields`` to add to: ``fields.add(name, type, default, help, choices=..., minimum=...,
        optional=..., check=...)``, ``fields.fact(name, default, help)``.
    :return: Nothing; the fields and facts go into ``fields``.
    """


@hookspec
def ultrascale_declare_mesh_axes(config: ParallelConfig) -> list[MeshAxis | MeshView] | None:
    """Declare the mesh axes this dimension needs. Their degrees multiply to the world size (degree 1
    allowed; one axis in the whole layout may have degree -1, the rest of the world); a ``MeshView`` counts the ranks
    of existing axes again and adds nothing to the world size. An axis is placed by name, ``after`` / ``before``
    the axes it lies inside / outside of (``ordering.order_by_names``, as the stages are).

    :param config: The layout, resolved or not.
    :return: ``mesh_axes.MeshAxis`` and ``mesh_axes.MeshView`` values, or None for none. A name two plugins
        declare, a name no plugin declares in ``after`` / ``before``, or a cycle is refused (``ConfigError``).
    """


@hookspec
def ultrascale_declare_facts(config: ParallelConfig, degrees: dict[str, int]) -> dict[str, Any] | None:
    """Decide the facts this plugin declared (``fields.fact`` in ``ultrascale_declare_fields``) for a layout, from its own
    fields and the mesh degrees, e.g. data parallel's ``{"fsdp_units": zero_stage >= 2}``. Other families read them
    from ``facts.layout_facts(config)`` instead of this plugin's fields. Called for each plugin in registration order.

    :param config: The layout, resolved or not; read only this plugin's own fields.
    :param degrees: Every declared mesh axis's degree (a view's axes too), by name.
    :return: ``{fact: value}`` for facts this plugin declared (a fact it leaves out keeps its declared default), or
        None. Each fact has one owner: one no plugin declares, or another plugin's, is refused (``ConfigError``).
    """


@hookspec(firstresult=True)
def ultrascale_declare_model_plan(model: nn.Module, config: ParallelConfig) -> ModelPlan | None:
    """Give the ``ModelPlan`` of a Hugging Face causal LM whose architecture this plugin knows.
    ``engine.model_plan`` asks, wherever the engine needs the plan.

    Stops at the first non-None result.

    :param model: The causal LM (a wrapper's inner model, e.g. a PEFT model's: the engine names the plan from the
        wrapper's root); it may live on the meta device.
    :param config: The layout (e.g. the ``tp`` degree, for head-parallel layers).
    :return: A ``ModelPlan``, or None to let another plugin answer.
    """


@hookspec
def ultrascale_declare_model_wrapper() -> WrapperLibrary | None:
    """Declare a library that wraps the causal LM the plans are for (PEFT: a PEFT model holds it at
    ``base_model.model``), as a ``model_wrapper.WrapperLibrary``: ``wrap(model)`` describes a model of its kind (the
    causal LM and its path, where each entry's pretrained value comes from, the initial values of what the wrapper
    introduced and of values computed from others, its own saved form), so the engine asks the plans of the inner
    model and names them from ``model``'s root, and every dimension finds the layers, the embedding and the head
    through the wrapper; ``adapter_factors(model, adapters)`` prices its adapters for the estimates and the planner's
    ``--peft``; ``export(checkpoint, form, out_dir, base, max_shard_bytes)`` writes a checkpoint in its own files
    (``ultrascale export --adapter`` / ``--merged``). Asked of every plugin, once per set of plugins (the registry
    keeps the libraries); each question goes to the libraries in pluggy's call order.

    Why a hook: a library that wraps the causal LM (an adapter library other than PEFT, a quantizing wrapper) tells
    the engine how to see through its models, what its adapters cost, and how to export them.

    :return: A ``model_wrapper.WrapperLibrary``, or None when this plugin owns no kind of wrapper.
    """


@hookspec
def ultrascale_declare_plan_edit(model: nn.Module, plan: ModelPlan, config: ParallelConfig) -> PlanEdit | None:
    """Edit the plan for modules this plugin introduces into ``model`` (adapters around a planned
    layer) or claims from the plan (experts for another dimension).

    Called wherever the engine makes the plan (``engine.model_plan``), right after ``ultrascale_declare_model_plan`` (and the
    wrapper's renaming) and before ``ultrascale_validate_model``. Every plugin's edit applies to that same plan, in
    pluggy's call order; two plugins that give one name different styles are refused (``ConfigError``). The plan's
    regions (what sequence parallel gathers) are then recomputed from the edited entries, so every dimension, the
    data-flow trace and the dry runs see the edited plan.

    :param model: The model as given, a wrapper included; the plan's names are from its root.
    :param plan: The plan as the other plugins made it; never None.
    :param config: The layout.
    :return: A ``plan_edit.PlanEdit``, or None for no edit.
    """


@hookspec
def ultrascale_declare_presets() -> list[Preset] | None:
    """Name layouts that front ends offer by name (Lightning registers each as the strategy
    ``ultrascale_<name>``: ``Trainer(strategy="ultrascale_cp", devices=8)``). Asked of every plugin; a name declared
    twice is refused (``ConfigError``).

    :return: ``presets.Preset`` values, or None for none.
    """


@hookspec
def ultrascale_declare_accelerate_keys() -> dict[str, tuple[str, dict]] | None:
    """Name the Accelerate ``parallelism_config`` size keys this dimension reads: the YAML key
    ``parallelism_config_<key>`` and the launcher's ``PARALLELISM_CONFIG_<KEY>``. Asked of every plugin wherever a
    front end reads Accelerate's configuration (``integrations/layout.py``).

    :return: ``{key: (field, implied)}``, or None for none: the key sets ``field`` to its value and the fields of
        ``implied`` (e.g. ``{"sp_size": ("cp", {"cp_method": "ulysses"})}``).
    """


@hookspec
def ultrascale_declare_recipe_sections() -> list[RecipeSection] | None:
    """Declare the sections of the command line's recipe this plugin reads: a feature configured from the recipe
    (PEFT's ``peft:`` adapters) without the recipe knowing it. The recipe reads, checks, saves, applies and
    compares each through its ``recipe_section.RecipeSection``. Asked of every plugin; a name declared twice, or
    one of the recipe's own sections, is refused (``ConfigError``).

    Why a hook: a plugin whose runs need settings of their own in the ``ultrascale train`` recipe (an adapter
    method, a data mixture) owns a section, as PEFT owns ``peft:``.

    :return: ``recipe_section.RecipeSection`` objects, or None for none.
    """


# ---- validate --------------------------------------------------------------------------------------------------------
# Before any process group: the layout chosen when asked, then checked against the world and the model.
@hookspec(firstresult=True)
def ultrascale_validate_choose_layout(config: ParallelConfig, model_config: PretrainedConfig | None, world_size: int) -> ParallelConfig | None:
    """Choose the concrete layout for one that asks to be chosen (the planner's ``layout: auto``).
    Asked first, before any check and any process group (``engine.validate``, a recipe's ``layout: auto``).

    Stops at the first non-None result.

    Why a hook: a placement policy of one's own (a site's scheduler, another planner) answers ``layout: auto``.

    :param config: The layout as written.
    :param model_config: The model's Hugging Face config, or None when only the world is known.
    :param world_size: The number of ranks.
    :return: The ``ParallelConfig`` to run, or None to keep ``config``.
    """


@hookspec
def ultrascale_validate_config(config: ParallelConfig, model_config: PretrainedConfig | None, world_size: int,
                               loop: TrainingLoop | None) -> None:
    """Check this dimension's part of the layout. Called before any process group: with
    ``model_config=None`` when the layout is resolved against the world size, and again with the Hugging Face config
    when the model is known; and with the training ``loop`` a front end will run (``engine.validate_loop``: each front
    end asks before its first step, with its own settings: the recipe's ``train``, the Trainer's arguments,
    Lightning's ``Trainer``, Accelerate's accumulation; ``model_config=None`` then). An implementation that does not
    name ``loop`` is not asked about loops, and its checks of the layout alone run again with ``model_config=None``.

    :param config: The resolved layout; when ``loop`` is given, the layout as the front end holds it.
    :param model_config: The model's Hugging Face config, or None.
    :param world_size: The number of ranks.
    :param loop: The ``training_loop.TrainingLoop`` a front end will run (micro-batches per optimizer step, the
        clipping norm), or None when only the layout is checked.
    :return: Nothing; raises ``ConfigError`` when this dimension's part of ``config`` (or ``loop``) cannot run.
    """


@hookspec
def ultrascale_validate_model(model: nn.Module, plan: ModelPlan | None, config: ParallelConfig) -> None:
    """Check this dimension against the model's structure. Called before any process group exists
    (``engine.validate``), after the plan is made and edited.

    :param model: The model to parallelize, real or on the meta device.
    :param plan: Its model plan, or None when no plugin plans it.
    :param config: The resolved layout.
    :return: Nothing; raises ``ConfigError`` when this dimension cannot run on this model.
    """


# ---- transform -------------------------------------------------------------------------------------------------------
# What it does to the model, as named stages the engine orders by their declarations.
@hookspec
def ultrascale_transform_stages(config: ParallelConfig, model_config: PretrainedConfig) -> list[Stage]:
    """Declare this plugin's model transforms as named stages: an ``interface.stages.Stage`` holds a name,
    the names it runs ``after`` and ``before``, its mesh ``axes``, what it ``does``, whether this layout uses it
    (``active``) and ``run(model, ctx)``. Declare every stage the plugin has, active or not, so that others can name
    it. The engine orders all plugins' stages by those declarations (``stages.order_stages``; a cycle or an unknown
    name is refused before any process group) and runs the active ones: the built-ins are ``split`` (pipeline;
    ``splits``: returns this rank's stages and their runtime), ``float8``, ``router_bias``, ``gpt2_heads``, ``ep``,
    ``tp`` (with sequence parallel), ``cp``, ``ac``, ``compile``, ``dp`` (FSDP2 or DDP: a wrapper that averages
    gradients over some axes itself says so with ``ctx.claim_grad_reduction(*axes)``; the engine averages the
    others). An implementation with ``wrapper=True`` is refused.

    :param config: The layout.
    :param model_config: The model's Hugging Face config, or None when only the world is known.
    :return: Every ``Stage`` this plugin declares, active or not; None or ``[]`` for none.
    """


# ---- step ------------------------------------------------------------------------------------------------------------
# Its part of every training step: the batch, the optimizer, the loss, accumulation, after the backward, the step
# itself.
@hookspec
def ultrascale_step_shard_batch(batch: dict[str, torch.Tensor], ctx: ParallelContext) -> None:
    """Take this rank's part of the batch in place, every tensor by the same positions, chosen from the
    batch's shape alone (``ParallelModel.outputs.token_places`` runs it on the positions themselves to put a
    row's tokens back together). Called on every step after the data loader's row split, before the forward.
    The implementations run in the order of the stages' names, each where its ``@step`` (``interface.stages``)
    places it: tensor parallel's padding at ``"tp"``, context parallel's head-tail split at ``"cp"``; one that
    declares no step runs last; ``wrapper=True``, ``tryfirst`` and ``trylast`` are refused.

    :param batch: This rank's rows, a dict of tensors: ``input_ids``, ``attention_mask``, ``position_ids``,
        ``targets`` (next-token targets, already shifted, -100 where ignored).
    :param ctx: The model's ``ParallelContext`` (its mesh, ``ctx.dims``, and ``ctx.plugin_state``).
    :return: Nothing; ``batch`` is changed in place.
    """


@hookspec(firstresult=True)
def ultrascale_step_optimizer(pmodel: ParallelModel, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """Replace the optimizer a front end trains with (ZeRO-1 partitions its states). Every front end's
    optimizer passes through here (``ParallelModel.prepare_optimizer``).

    Stops at the first non-None result.

    :param pmodel: The ``ParallelModel`` the optimizer trains.
    :param optimizer: An optimizer over ``pmodel``'s (sharded) parameters.
    :return: The optimizer to train with instead, or None to keep ``optimizer``.
    """


@hookspec
def ultrascale_step_loss(pmodel: ParallelModel) -> LossPart | None:
    """Give this plugin's part in how the step's loss is computed, a ``loss_part.LossPart``: the context the loss
    and its backward run inside (``context()``: tensor parallel's vocabulary-parallel cross-entropy, torch's
    ``loss_parallel``) and the terms added to each forward's objective besides the token loss (``terms(output,
    batch)``: a mixture of experts' router auxiliary loss; each the same value on every rank holding tokens, each
    rank's gradient its share). Asked once per parallel model, when it is made (``ParallelModel.loss_parts``); every
    step enters every part's context (``ParallelModel.loss_context``) and folds in every part's terms
    (``outputs.loss_terms``, with the loss-scale rule): the built-in step and a pipeline's last stage alike.

    Why a hook: a loss of one's own (a context of its own such as a fused kernel's, an auxiliary term such as a
    regularizer) joins the loss in every front end.

    :param pmodel: The ``ParallelModel`` whose loss this part shapes.
    :return: A ``LossPart``, or None when this plugin changes nothing in this model's loss.
    """


@hookspec
def ultrascale_step_no_sync(pmodel: ParallelModel) -> AbstractContextManager | None:
    """Give a context manager under which this dimension's wrappers keep gradients local (gradient
    accumulation: FSDP2's and DDP's reductions off). ``ParallelModel.no_sync`` enters every plugin's; the engine holds
    back its own reduction of the axes nobody claims too.

    :param pmodel: The ``ParallelModel`` whose gradients accumulate.
    :return: A context manager, or None.
    """


@hookspec
def ultrascale_step_after_backward(pmodel: ParallelModel) -> None:
    """Do the work that depends on the whole step (a router's load-balancing bias from the step's token
    counts). Called on every rank once the gradients of an optimizer step are complete and reduced (after the last
    micro-batch's backward, never inside ``no_sync``), before the optimizer steps.

    Why a hook: work that needs the step's complete gradients or counts (a router's bias update, gradient
    statistics) runs once per step, after every wrapper has reduced them.

    :param pmodel: The ``ParallelModel`` whose backward finished.
    :return: Nothing.
    """


@hookspec(firstresult=True)
def ultrascale_step_run(pmodel: ParallelModel, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
    """Run forward and backward on this rank's batch (``ParallelModel.train_step``). The built-in step
    (``core/step.py``, ``trylast``) runs the model's runtime; a plugin may replace it or wrap it
    (``@hookimpl(wrapper=True)``: ``loss = yield``).

    Stops at the first non-None result.

    Why a hook: a step of one's own (another schedule, instrumentation) replaces or wraps the built-in one in every
    front end.

    :param pmodel: The ``ParallelModel`` to train.
    :param batch: This rank's rows, as the data loader gives them (``ultrascale_step_shard_batch`` runs inside the step).
    :param loss_scale: The gradients are those of ``loss_scale`` times the loss, added to any already there.
    :return: The global-mean loss: a 0-d tensor, the same on every rank.
    """


# ---- state -----------------------------------------------------------------------------------------------------------
# What it keeps in checkpoints and how a checkpoint of its model is exported.
@hookspec
def ultrascale_state_save(pmodel: ParallelModel, state: PluginState) -> None:
    """Add this dimension's entries to a checkpoint's state: ``state.shared[key]`` for what every rank
    holds alike (tensors go into the sharded files, other values into JSON) and ``state.rank_local[key]`` for what
    differs per rank (restored only in the same world size); ``state.left_out``: the model's entries (unparallelized
    names) to keep out of the checkpoint, which the caller's model supplies on load (a PEFT model's frozen base). A
    load asks this hook first, with ``state.loading`` set to the checkpoint's metadata: a plugin leaves out there what
    the checkpoint lacks, and may refuse the checkpoint (raise ``ConfigError``) before anything is read.

    :param pmodel: The ``ParallelModel`` saved or loaded.
    :param state: The ``protocols.PluginState`` to add to (``state.loading`` None on a save).
    :return: Nothing; the entries go into ``state``.
    """


@hookspec
def ultrascale_state_load(pmodel: ParallelModel, state: PluginState) -> None:
    """Restore this dimension's entries once a checkpoint's model state is loaded (a sharded load,
    ``ParallelModel.load_state_dict``).

    Why a hook: a plugin that saves state with ``ultrascale_state_save`` reads it back on resume, in any layout.

    :param pmodel: The ``ParallelModel`` loaded into.
    :param state: The ``protocols.PluginState`` as saved (``state.rank_local`` empty in another world size).
    :return: Nothing.
    """


@hookspec(firstresult=True)
def ultrascale_state_checkpoint_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """Show a tensor as a distributed checkpoint (DCP) must see it when this dimension placed it in
    pieces DCP cannot describe (TP-packed parameters: a rank's pieces of q|k|v are not adjacent in the whole tensor).
    Every sharded save and load, and pretrained loading, ask it per tensor.

    Stops at the first non-None result.

    Why a hook: a dimension that places tensors in pieces DCP cannot describe (a packed fused projection) lists
    them, so checkpoints save and reshard them.

    :param tensor: A tensor of the model's or the optimizer's state.
    :return: The view DCP saves and loads (views of ``tensor``, so a load fills it), or None to save and load
        ``tensor`` as it is.
    """


# ---- cost ------------------------------------------------------------------------------------------------------------
# What a layout costs one rank, for the estimate and the planner.
@hookspec
def ultrascale_cost_estimate(config: ParallelConfig, model_config: PretrainedConfig, shape: Shape, estimate: Estimate) -> None:
    """Add this dimension's per-rank costs to the estimate: memory in bytes per category
    (``estimate.add_memory("params" | "grads" | "optimizer" | "activations" | "other", n)``), communication
    (``estimate.add_comm(axis, nbytes, collective, calls=, per="step" | "micro_batch", overlap=)``) and compute
    factors (``estimate.factors``: ``recompute_flops``, ``bubble``).

    ``shape.inventory`` holds the model's parameters, which the dimensions cut in turn, in the order of the stages'
    names: each implementation runs where its ``@step(name, after=, before=)`` (``interface.stages``) places it, at
    a stage's place or at a name of its own among them. The built-ins: ``cp_tokens`` (before ``split``: context
    parallel narrows ``shape.seq_len`` to a rank's tokens; the engine restores it after the chain), ``split`` (the
    pipeline: this rank's stages, ``layers_here``, ``in_flight``, ``holds_head``), ``activations``, ``ep``, ``tp``
    (each record's ``local`` shape), ``chunked_loss``, ``dp`` (shards what is left and adds parameter, gradient and
    optimizer bytes), ``cp_exchanges`` (after ``dp``: reads the gradient bytes). An estimate that reads tensor
    parallel's cut declares ``after="tp"``; one that declares no step runs last; ``wrapper=True``, ``tryfirst`` and
    ``trylast`` are refused. ``us.describe`` prints the chain in order.

    :param config: The resolved layout.
    :param model_config: The model's Hugging Face config.
    :param shape: An ``estimates.Shape``: what the estimate is for (``seq_len``, ``micro_batch``, ``micro_batches``,
        ``profile``, ``optimizer``, ``coords``: the rank) and ``shape.inventory``.
    :param estimate: The ``estimates.Estimate`` to add to.
    :return: Nothing; the costs go into ``estimate``.
    """


@hookspec
def ultrascale_cost_comm_minimum(config: ParallelConfig, shape: Shape) -> list[MinimumTerm] | None:
    """State the least communication this dimension's mesh axes need for one optimizer step on one rank (the
    Ultra-Scale Playbook's formulas for the built-in families, each in its folder). A plugin's own mesh axis gets a
    minimum the communication report (``ParallelModel.profile_step``) compares its ledger with; an axis no plugin
    answers for has none, and the report's rows say so. Asked of every plugin; the answers are concatenated.

    :param config: The resolved layout.
    :param shape: The ``estimates.Shape`` as ``ultrascale_cost_estimate`` left it: the inventory cut to this rank's share
        (tensor and pipeline parallel's, expert parallel's experts), ``layers_here``, ``holds_head``, ``coords``.
    :return: ``comm_minimum.MinimumTerm`` values (axis, collective, calls and payload per step in the ledger's units,
        the formula in words), or None for axes it does not own.
    """


@hookspec
def ultrascale_cost_search(config: ParallelConfig, model_config: PretrainedConfig, world_size: int) -> SearchOffer | None:
    """Offer values of this plugin's layout fields worth costing with a candidate of the planner's search
    (``ultrascale plan``, ``layout: auto``), as a ``search_offer.SearchOffer``: ``choices`` tried with every candidate
    (expert parallelism: ``{"ep": [1, 2, 4, 8]}``, the degrees that divide the experts and dp_shard*cp*tp; list the
    default too when the candidate without the feature is worth costing), ``savers`` that save memory at a price in
    time, tried once no layout fits without them (the chunked loss: ``{"chunked_loss": [1024]}``; data parallel:
    ``{"cpu_offload": [True]}``), then ``lossy`` ones that change the numbers, tried once none fits with the savers
    alone (``{"param_dtype": ["bf16"]}``). The search costs every combination of every plugin's values with the
    candidate (savers and lossy values with the field's current value too), each checked
    (``ultrascale_validate_config``) and costed (``ultrascale_cost_estimate``) like any layout; the chosen layout carries
    them into the printed snippets and into ``layout: auto``, with what each saver costs against the same layout
    without it. Values must keep the world size: a field that is an axis of a ``MeshView`` or no mesh axis at all,
    not a degree that multiplies the layout's mesh.

    :param config: The candidate: the built-in degrees, ZeRO stage and schedule, resolved for ``world_size``, with
        every plugin field at its default.
    :param model_config: The model's Hugging Face config.
    :param world_size: The number of GPUs the search is for.
    :return: A ``SearchOffer`` of ``{field: [value, ...]}`` dicts, or None when this plugin has nothing to try with it.
    """


@hookspec(firstresult=True)
def ultrascale_cost_schedule(config: ParallelConfig) -> StepSchedule | None:
    """Say how one training step runs its micro-batches inside this dimension (a pipeline's schedule): how many
    (recipes derive their batch split from it; ``ParallelModel.tokens.microbatches_inside`` reports it), the ranks
    along its mesh axes worth costing (the planner estimates every combination and takes the most loaded), and
    their timeline (``ultrascale plan --plot`` draws it). A step runs one schedule: the first answer is it.

    Stops at the first non-None result.

    Why a hook: a dimension that runs several micro-batches inside a step with a schedule (a pipeline) tells the
    recipe, the planner and the plot about it.

    :param config: The resolved layout.
    :return: A ``step_schedule.StepSchedule`` (a subclass with its own ``timeline``), or None when this dimension
        runs no schedule in this layout (no answer: one micro-batch, every rank costing alike).
    """


# The hooks by what they are for (docs/writing-a-plugin.md walks through them in this order).
GROUPS = {
    "declare": ("ultrascale_declare_fields", "ultrascale_declare_mesh_axes", "ultrascale_declare_facts",
                "ultrascale_declare_model_plan", "ultrascale_declare_model_wrapper", "ultrascale_declare_plan_edit",
                "ultrascale_declare_presets", "ultrascale_declare_accelerate_keys",
                "ultrascale_declare_recipe_sections"),
    "validate": ("ultrascale_validate_choose_layout", "ultrascale_validate_config", "ultrascale_validate_model"),
    "transform": ("ultrascale_transform_stages",),
    "step": ("ultrascale_step_shard_batch", "ultrascale_step_optimizer", "ultrascale_step_loss",
             "ultrascale_step_no_sync", "ultrascale_step_after_backward", "ultrascale_step_run"),
    "state": ("ultrascale_state_save", "ultrascale_state_load", "ultrascale_state_checkpoint_view"),
    "cost": ("ultrascale_cost_estimate", "ultrascale_cost_comm_minimum", "ultrascale_cost_search",
             "ultrascale_cost_schedule"),
}

"""What a parallelism dimension is: the pluggy hook specifications, in six groups.

Every built-in dimension and feature (data parallel / ZeRO, tensor and sequence parallel, pipeline, context and
expert parallel, PEFT, routers, float8, compile, activation checkpointing, the training step, the model plans)
implements these hooks exactly as a third-party plugin registered under the ``ultrascale_plugins`` entry point
would. Hook names start with ``ultrascale_``; an implementation whose name matches no specification is rejected
when plugins load. ``GROUPS`` lists them by what they are for, in the order the engine asks:

- **declare**: the plugin's layout fields and mesh axes, the facts it decides for other families to read, the
  model plans it knows (and its additions to other plugins' plans), a model wrapper it owns (a PEFT model:
  ``model_wrapper.ModelWrapper``), the names front ends offer (Lightning strategies, Accelerate keys);
- **validate**: before any process group, the layout chosen when asked (``layout: auto``), then checked against the
  world size, the model's config and its structure;
- **transform**: its model transforms as named stages, each declaring which stages it runs after and before
  (``interface.stages`` orders them);
- **step**: its part of every step: the batch, the optimizer, the loss (how it is computed, what is added to it),
  gradient accumulation, what follows the last backward, the step itself (replace it, or wrap it with a
  ``@hookimpl(wrapper=True)`` generator);
- **state**: its entries in checkpoints, tensors placed in pieces DCP cannot describe, its own exported forms;
- **cost**: its per-rank costs, the adapters it prices, the micro-batches of a step, the ranks worth costing, the
  values the planner's search should try, a schedule's timeline for the plot.

A family's own runtime needs are methods of its own objects, not hooks: a pipeline's schedule is its
``interface.runtime.Runtime`` subclass, PEFT's names and initialization its ``ModelWrapper``.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import pluggy

# The annotations below are names only (this module imports nothing of the package, so every module may import
# it): ParallelConfig (interface.config), Fields (interface.fields), MeshAxis / MeshView (interface.parallel_dims),
# PlanEdit (interface.plan_edit), Preset (interface.presets), LayoutFacts (interface.facts), Runtime (interface.runtime), Stage
# (interface.stages), Estimate / Shape / Adapters / AdapterFactor (interface.estimates), ModelWrapper
# (interface.model_wrapper), ModelPlan (models.plan), ParallelContext / ParallelModel (core.engine), PluginState
# (checkpoints.sharded), SavedCheckpoint (checkpoints.export); nn (torch.nn),
# PretrainedConfig (transformers).

PROJECT = "ultrascale_plugins"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---- declare ---------------------------------------------------------------------------------------------------------
# What the plugin adds: its layout fields and mesh axes, the model plans it knows, a wrapper it owns, the names
# front ends offer.
@hookspec
def ultrascale_add_fields(fields: Fields) -> None:
    """Declare this dimension's layout fields: ``fields.add(name, type, default, help, choices=..., minimum=...,
    optional=..., check=...)`` (see ``fields.Fields``). They become valid everywhere a layout is written."""


@hookspec
def ultrascale_mesh_axes(config: ParallelConfig) -> list[MeshAxis | MeshView] | None:
    """Return the ``parallel_dims.MeshAxis`` values this dimension needs for ``config`` (degree 1 allowed; one axis
    in the whole layout may have degree -1, the rest of the world). Their product is the world size."""


@hookspec
def ultrascale_layout_facts(config: ParallelConfig, degrees: dict[str, int]) -> dict[str, Any] | None:
    """Return ``{flag: value}`` for the ``facts.LayoutFacts`` flags this plugin owns, decided from its own fields
    of ``config`` (resolved or not) and the mesh degrees (``degrees``: every declared axis, by name), e.g. data
    parallel's ``{"fsdp_units": zero_stage >= 2}``. Other families read them from ``facts.layout_facts(config)``
    instead of this plugin's fields. Each flag has one owner."""


@hookspec(firstresult=True)
def ultrascale_model_plan(model: nn.Module, config: ParallelConfig) -> ModelPlan | None:
    """Return a ``ModelPlan`` for this Hugging Face model, or None to let another plugin answer."""


@hookspec(firstresult=True)
def ultrascale_model_wrapper(model: nn.Module) -> ModelWrapper | None:
    """When ``model`` wraps the causal LM the plans are for (a PEFT model holds it at ``base_model.model``), return
    a ``model_wrapper.ModelWrapper`` describing it: the causal LM and its path, where each entry's pretrained value
    comes from, the initial values of what the wrapper introduced and of values computed from others, its own saved
    form. The engine asks the plans of the inner model and names them from ``model``'s root, so every dimension
    finds the layers, the embedding and the head through the wrapper. None when ``model`` is not this plugin's."""


@hookspec
def ultrascale_extend_plan(model: nn.Module, plan: ModelPlan, config: ParallelConfig) -> PlanEdit | None:
    """Return a ``plan_edit.PlanEdit`` for modules this plugin introduces into ``model`` (adapters around a planned
    layer) or claims from the plan (experts for another dimension), or None.

    Called wherever the engine makes the plan (``engine.model_plan``), right after ``ultrascale_model_plan`` (and
    the wrapper's renaming) and before ``ultrascale_validate_model``, with the plan as the other plugins made it
    (names from ``model``'s root); never with ``plan=None``. Every plugin's edit applies to that same plan, in
    pluggy's call order; two plugins that give one name different styles are refused (``ConfigError``). The
    plan's regions (what sequence parallel gathers) are then recomputed from the edited entries, so every
    dimension, the data-flow trace and the dry runs see the edited plan."""


@hookspec
def ultrascale_presets() -> list[Preset] | None:
    """Return named layouts (``presets.Preset``) that front ends offer by name: Lightning registers each as the
    strategy ``ultrascale_<name>`` (``Trainer(strategy="ultrascale_cp", devices=8)``)."""


@hookspec
def ultrascale_accelerate_keys() -> dict[str, tuple[str, dict]] | None:
    """Return the Accelerate ``parallelism_config`` size keys this dimension reads, as ``{key: (field, implied)}``:
    the YAML key ``parallelism_config_<key>`` and the launcher's ``PARALLELISM_CONFIG_<KEY>`` set ``field`` to
    their value and the fields of ``implied`` (e.g. ``{"sp_size": ("cp", {"cp_method": "ulysses"})}``)."""


# ---- validate --------------------------------------------------------------------------------------------------------
# Before any process group: the layout chosen when asked, then checked against the world and the model.
@hookspec(firstresult=True)
def ultrascale_resolve_layout(config: ParallelConfig, model_config: PretrainedConfig | None, world_size: int) -> ParallelConfig | None:
    """Return the concrete ``ParallelConfig`` to run for a layout that asks to be chosen (the planner's
    ``layout: auto``), or None to keep ``config``. Asked first, before any check and any process group."""


@hookspec
def ultrascale_validate_config(config: ParallelConfig, model_config: PretrainedConfig | None, world_size: int) -> None:
    """Raise ``ConfigError`` when this dimension's part of ``config`` cannot run. Called before any process group:
    with ``model_config=None`` when the layout is resolved against the world size, and again with the Hugging
    Face config when the model is known."""


@hookspec
def ultrascale_validate_model(model: nn.Module, plan: ModelPlan | None, config: ParallelConfig) -> None:
    """Raise ``ConfigError`` when this dimension cannot run on this model's structure. Called before any process
    group exists; ``model`` may live on the meta device, ``plan`` is the model plan (or None)."""


@hookspec
def ultrascale_validate_loop(config: ParallelConfig, micro_batches: int, max_grad_norm: float | None) -> None:
    """Raise ``ConfigError`` when this dimension cannot run the training loop a front end will run: ``micro_batches``
    forwards and backwards per optimizer step (gradient accumulation), the gradients clipped to a global norm of
    ``max_grad_norm`` (None or 0: not clipped). Each front end asks before its first step, with its own settings
    (the recipe's ``train``, the Trainer's arguments, Lightning's ``Trainer``, Accelerate's accumulation)."""


# ---- transform -------------------------------------------------------------------------------------------------------
# What it does to the model, as named stages the engine orders by their declarations.
@hookspec
def ultrascale_stages(config: ParallelConfig, model_config: PretrainedConfig) -> list[Stage]:
    """This plugin's model transforms for the layout ``config`` and the model of ``model_config`` (None when only
    the world is known): a list of ``interface.stages.Stage`` — a name,
    the names it runs ``after`` and ``before``, its mesh ``axes``, what it ``does``, whether this layout uses it
    (``active``) and ``run(model, ctx)``. Declare every stage the plugin has, active or not, so that others can
    name it. The engine orders all plugins' stages by those declarations (``stages.order_stages``; a cycle or an
    unknown name is refused before any process group) and runs the active ones: the built-ins are ``split``
    (pipeline; ``splits``: returns this rank's stages and their runtime), ``float8``, ``router_bias``,
    ``gpt2_heads``, ``ep``, ``tp`` (with sequence parallel), ``cp``, ``ac``, ``compile``, ``dp`` (FSDP2 or DDP:
    a wrapper that averages gradients over some axes itself says so with ``ctx.claim_grad_reduction(*axes)``;
    the engine averages the others)."""


# ---- step ------------------------------------------------------------------------------------------------------------
# Its part of every training step: the batch, the optimizer, the loss, accumulation, after the backward, the step
# itself.
@hookspec
def ultrascale_shard_batch(batch: dict[str, torch.Tensor], ctx: ParallelContext) -> None:
    """Take this rank's part of ``batch`` in place (a dict of tensors: ``input_ids``, ``attention_mask``,
    ``position_ids``, ``targets`` — next-token targets, already shifted, -100 where ignored), every tensor by the
    same positions, chosen from the batch's shape alone (``ParallelModel.token_places`` runs it on the positions
    themselves to put a row's tokens back together). Called on every step after the data loader's row split,
    before the forward."""


@hookspec(firstresult=True)
def ultrascale_prepare_optimizer(pmodel: ParallelModel, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """Return the optimizer to train ``pmodel`` with instead of ``optimizer`` (ZeRO-1 partitions its states), or
    None to keep it. Every front end's optimizer passes through here."""


@hookspec
def ultrascale_loss_context(pmodel: ParallelModel) -> AbstractContextManager | None:
    """Return a context manager that the loss and its backward run inside (tensor parallel's vocabulary-parallel
    cross-entropy: torch's ``loss_parallel``), or None. Every step enters every plugin's: the built-in one and a
    pipeline's schedule alike."""


@hookspec
def ultrascale_forward_targets(pmodel: ParallelModel, targets: torch.Tensor,
                               per_token: bool) -> AbstractContextManager | None:
    """Return a context manager that one micro-batch's forward runs inside, given that micro-batch's next-token
    ``targets`` (this rank's part, shifted, -100 where ignored), or None: a head that computes the loss inside the
    model's forward reads them there (the chunked loss). Every runtime enters every plugin's around each
    micro-batch's forward (a pipeline: around its last stage's). ``per_token``: the caller wants each token's
    figures (``ultrascale_token_outputs``: a trainer computing its own loss), not the loss's sum."""


@hookspec(firstresult=True)
def ultrascale_token_outputs(pmodel: ParallelModel, logits: torch.Tensor, targets: torch.Tensor) -> Any:
    """Return each token's log-probability, entropy and top-1 hit (a ``distributed.loss.TokenOutputs``) when the
    model's forward computed them (run with ``per_token``; ``logits`` is what the output holds there), or None:
    the engine computes them from the whole logits. First answer wins."""


@hookspec(firstresult=True)
def ultrascale_loss_sum(pmodel: ParallelModel, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """Return this rank's token-loss sum of one micro-batch when the model's forward computed it (``logits`` is
    what the model's output holds there), or None for the built-in cross-entropy of ``logits`` against
    ``targets``. First answer wins."""


@hookspec
def ultrascale_loss_terms(pmodel: ParallelModel, output: Any, batch: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
    """Return terms to add to the step's objective for this forward, besides the token loss (a list of 0-d
    tensors), or None: a mixture of experts' router auxiliary loss. ``output`` is the model's output, ``batch``
    this rank's prepared inputs. Each term has the same value on every rank that holds tokens of the global batch
    (the token-counting axes), and on each rank the gradient of that rank's share, the shares' gradients summing
    over those ranks to the term's gradient (e.g. statistics gathered from every rank, the gradient kept on this
    rank's own). The engine folds each into the loss so that the step's value and gradient include it once."""


@hookspec
def ultrascale_no_sync(pmodel: ParallelModel) -> AbstractContextManager | None:
    """Return a context manager under which this dimension's wrappers keep gradients local (gradient
    accumulation: FSDP2's and DDP's reductions off), or None. ``ParallelModel.no_sync`` enters every plugin's;
    the engine holds back its own reduction of the axes nobody claims too."""


@hookspec
def ultrascale_after_backward(pmodel: ParallelModel) -> None:
    """Called on every rank once the gradients of an optimizer step are complete and reduced (after the last
    micro-batch's backward, never inside ``no_sync``), before the optimizer steps: updates that depend on the
    whole step (a router's load-balancing bias from the step's token counts)."""


@hookspec(firstresult=True)
def ultrascale_train_step(pmodel: ParallelModel, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
    """Run forward and backward on this rank's batch and return the global-mean loss (a 0-d tensor, the same on
    every rank). Gradients are those of ``loss_scale`` times that loss. The built-in step (``core/step.py``) runs the
    model's runtime; a plugin may replace it (first result wins) or wrap it (``@hookimpl(wrapper=True)``)."""


# ---- state -----------------------------------------------------------------------------------------------------------
# What it keeps in checkpoints and how a checkpoint of its model is exported.
@hookspec
def ultrascale_state_dict(pmodel: ParallelModel, state: PluginState) -> None:
    """Add this dimension's entries to ``state`` (a ``checkpoint.PluginState``): ``state.shared[key]`` for what
    every rank holds alike (tensors go into the sharded files, other values into JSON) and
    ``state.rank_local[key]`` for what differs per rank (restored only in the same world size).
    ``state.left_out``: the model's entries (unparallelized names) to keep out of the checkpoint, which the caller's
    model supplies on load (a PEFT model's frozen base). A load asks this hook first, with ``state.loading`` set to
    the checkpoint's metadata (None on a save): a plugin leaves out there what the checkpoint lacks, and may refuse
    the checkpoint (raise ``ConfigError``) before anything is read."""


@hookspec
def ultrascale_load_state_dict(pmodel: ParallelModel, state: PluginState) -> None:
    """Restore this dimension's entries from ``state`` (a ``checkpoint.PluginState``, as saved)."""


@hookspec(firstresult=True)
def ultrascale_checkpoint_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """Return ``tensor`` as a distributed checkpoint (DCP) must see it when this dimension placed it in pieces DCP
    cannot describe (TP-packed parameters: a rank's pieces of q|k|v are not adjacent in the whole tensor), or
    None to save and load it as it is. Every sharded save and load, and pretrained loading, ask it per tensor."""


@hookspec(firstresult=True)
def ultrascale_export(checkpoint: SavedCheckpoint, form: str, out_dir: str, base: str | None, max_shard_bytes: int) -> bool | None:
    """Write the sharded checkpoint ``checkpoint`` (a ``checkpoints.export.SavedCheckpoint``: ``path``, ``meta``,
    ``config`` (its transformers config), ``names`` (the model tensors it holds) and ``read(names)``, those
    tensors whole on the CPU, read in this one process) into the new directory ``out_dir`` in the form ``form``
    (``"adapter"``: PEFT's own files; ``"merged"``: a plain transformers model with the adapters folded in, the
    frozen base from the directory ``base`` when given) and return True, when this plugin's model wrote it (a PEFT
    model's); None leaves it to another plugin. ``ultrascale export --adapter`` / ``--merged``."""


# ---- cost ------------------------------------------------------------------------------------------------------------
# What a layout costs one rank, for the estimate and the planner.
@hookspec
def ultrascale_estimate(config: ParallelConfig, model_config: PretrainedConfig, shape: Shape, estimate: Estimate) -> None:
    """Add this dimension's per-rank costs to ``estimate`` (an ``estimates.Estimate``): memory in bytes per
    category (``estimate.add_memory("params" | "grads" | "optimizer" | "activations" | "other", n)``),
    communication (``estimate.add_comm(axis, nbytes, collective, calls=, per="step" | "micro_batch",
    overlap=)``) and compute factors (``estimate.factors``: ``recompute_flops``, ``bubble``).

    ``shape`` (an ``estimates.Shape``) says what the estimate is for — ``seq_len``, ``micro_batch``,
    ``micro_batches``, ``profile``, ``optimizer``, ``coords`` (the rank) — and holds the model's parameters as
    ``shape.inventory``, which the dimensions cut in turn: the pipeline first (``tryfirst``: this rank's stages,
    ``layers_here``, ``in_flight``, ``holds_head``), tensor parallel next (each record's ``local`` shape), data
    parallel last (``trylast``: shards what is left and adds parameter, gradient and optimizer bytes). A
    dimension that changes what the others see (context parallel: the tokens per rank) or needs their totals
    (a replica axis: the gradient bytes) is a ``wrapper=True`` implementation around them."""


@hookspec
def ultrascale_adapter_factors(model: nn.Module, adapters: Adapters | None) -> list[AdapterFactor] | None:
    """Return the adapter factors this plugin's adapters put on ``model``, as ``estimates.AdapterFactor`` values,
    so the estimates price them: with ``adapters`` None, the factors ``model`` holds (a PEFT model's LoRA
    layers); with an ``estimates.Adapters`` whose ``method`` this plugin owns, the factors it would add to a model
    that has none, with their shapes (the planner's ``--peft lora``). None when it has none or does not own the
    method."""


@hookspec(firstresult=True)
def ultrascale_microbatches(config: ParallelConfig) -> int | None:
    """Return how many micro-batches one training step of ``config`` (resolved) runs inside this dimension (a
    pipeline schedule's), or None when this dimension does not decide it. Recipes derive their batch split from
    it."""


@hookspec
def ultrascale_cost_coordinates(config: ParallelConfig) -> dict[str, list[int]] | None:
    """Return ``{axis: [index, ...]}``, the positions along this dimension's mesh axes whose ranks can differ in
    cost (a pipeline's first, second and last stages), or None when every rank costs the same along them. The
    planner estimates the ranks of every combination and takes the most loaded."""


@hookspec
def ultrascale_search_choices(config: ParallelConfig, model_config: PretrainedConfig, world_size: int) -> dict[str, list] | None:
    """Return ``{field: [value, ...]}``: the values of this plugin's layout fields worth costing with ``config``, a
    candidate of the planner's search (``ultrascale plan``, ``layout: auto``) — the built-in degrees, ZeRO stage and
    schedule, resolved for ``world_size`` GPUs, with every plugin field at its default — or None (or ``{}``) when
    this plugin has nothing to try with it. List the default too when the candidate without this plugin's feature
    is worth costing (expert parallelism: ``{"ep": [1, 2, 4, 8]}``, the degrees that divide the experts and
    dp_shard*cp*tp). The search costs every combination of every plugin's values with the candidate, each checked
    (``ultrascale_validate_config``) and costed (``ultrascale_estimate``) like any layout; the chosen layout
    carries them into the printed snippets and into ``layout: auto``. Values must keep the world size: a field
    that is an axis of a ``MeshView`` or no mesh axis at all, not a degree that multiplies the layout's mesh."""


@hookspec
def ultrascale_search_savers(config: ParallelConfig, model_config: PretrainedConfig, world_size: int,
                             lossy: bool) -> dict[str, list] | None:
    """Return ``{field: [value, ...]}``: values of this plugin's layout fields that save memory at a price, worth
    costing with ``config`` (as ``ultrascale_search_choices``) only when nothing fits without them: in time
    (``lossy=False``: a loss computed in chunks, states held on the host), or in the numbers (``lossy=True``:
    states held in bf16). The planner searches the first kind once no layout fits without them, the second once
    none fits with the first kind alone, each in every combination with the field's current value, and says
    what each costs against the same layout without it."""


@hookspec(firstresult=True)
def ultrascale_schedule_timeline(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> list[list[tuple]] | None:
    """Return, per rank of a schedule this dimension runs (a pipeline's), its actions as (start, end, kind,
    micro-batch, chunk) in units of one forward of one micro-batch on one stage, or None for a schedule it does
    not know. The planner's plot draws it."""


# The hooks by what they are for (docs/writing-a-plugin.md walks through them in this order).
GROUPS = {
    "declare": ("ultrascale_add_fields", "ultrascale_mesh_axes", "ultrascale_layout_facts", "ultrascale_model_plan",
                "ultrascale_model_wrapper", "ultrascale_extend_plan", "ultrascale_presets",
                "ultrascale_accelerate_keys"),
    "validate": ("ultrascale_resolve_layout", "ultrascale_validate_config", "ultrascale_validate_model",
                 "ultrascale_validate_loop"),
    "transform": ("ultrascale_stages",),
    "step": ("ultrascale_shard_batch", "ultrascale_prepare_optimizer", "ultrascale_loss_context",
             "ultrascale_forward_targets", "ultrascale_token_outputs", "ultrascale_loss_sum",
             "ultrascale_loss_terms", "ultrascale_no_sync",
             "ultrascale_after_backward", "ultrascale_train_step"),
    "state": ("ultrascale_state_dict", "ultrascale_load_state_dict", "ultrascale_checkpoint_view",
              "ultrascale_export"),
    "cost": ("ultrascale_estimate", "ultrascale_adapter_factors", "ultrascale_microbatches",
             "ultrascale_cost_coordinates", "ultrascale_search_choices", "ultrascale_search_savers",
             "ultrascale_schedule_timeline"),
}

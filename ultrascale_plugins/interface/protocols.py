"""The engine's objects as the hooks hand them to a plugin: what each offers, as ``typing.Protocol`` classes.

The hookspecs (``interface.hookspecs``) speak of a ``ParallelContext``, a ``ParallelModel``, a ``PluginState``, a
``SavedCheckpoint`` and a ``ModelPlan``. The concrete classes live above this layer: ``ParallelContext`` in
``core.engine``, ``ParallelModel`` in ``core.parallel_model`` (its ``tokens``, ``outputs`` and ``gradients`` in
``core.tokens``, ``core.outputs`` and ``core.gradients``), ``PluginState`` in ``core.plugin_state`` (filled by the
sharded checkpoints, ``checkpoints.sharded``), ``SavedCheckpoint`` in ``checkpoints.export`` and ``ModelPlan`` in
``models.plan``. Each protocol lists only what the built-in families (``dims/``, ``features/``, ``models/``) and
third-party plugins use of that object, so that a plugin's author reads the contract here, and the engine is free
to change everything else. ``tests/test_hookspecs.py`` checks that each concrete class offers every member listed.

This module imports nothing of the package outside ``interface/``; its annotations are resolved under
``TYPE_CHECKING`` only.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    import pluggy
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig

    from .config import ParallelConfig
    from .loss_head import LossHead
    from .parallel_dims import ParallelDims
    from .runtime import Runtime


class ModelPlan(Protocol):
    """What the engine's model plan (``models.plan.ModelPlan``) offers a plugin: one model's structure by module
    name (FQN, from the root of the model as given, a wrapper's included)."""

    tp_plan: dict[str, str]  # tensor-parallel style by module or parameter name (``*`` wildcards allowed)
    layers: list[str]  # the decoder layers, in order
    regions: list[str]  # the blocks sequence parallel gathers the activations of (recomputed after every edit)
    embedding: str | None  # the token embedding
    lm_head: str | None  # the output head
    tied: bool  # whether the head shares the embedding's weight
    styles: dict[str, Callable[..., Any]]  # style names an architecture or plugin adds: name -> factory
    root: str  # where the causal LM the plan was made for sits in the model ("" for the model itself)
    views: dict[str, str]  # modules whose parameters are data-parallel in a mesh view: FQN -> view name

    def whole_output_styles(self) -> set[str]:
        """The styles whose module hands its output back whole on every TP rank inside a region."""

    def view_of(self, fqn: str) -> str | None:
        """The mesh view of module (or parameter) ``fqn``; None for the layout's own mesh."""

    def causal_lm(self, model: nn.Module) -> nn.Module:
        """The causal LM this plan was made for: ``model`` itself, or the one a wrapper holds at ``root``."""

    def matches(self, model: nn.Module) -> dict[str, str]:
        """``tp_plan`` expanded against ``model``'s modules: {module FQN: style}."""

    def styles_module(self, model: nn.Module, fqn: str) -> bool:
        """Whether ``model`` has the module ``fqn`` and ``tp_plan`` gives it a style."""

    def param_matches(self, model: nn.Module) -> dict[str, str]:
        """``tp_plan``'s entries that name parameters of ``model``: {parameter FQN: style}."""


class ParallelContext(Protocol):
    """What the engine's context (``core.engine.ParallelContext``) offers a plugin while the model is transformed
    (a stage's ``run(model, ctx)``) and on every step (``ultrascale_step_shard_batch``)."""

    dims: ParallelDims  # the resolved layout: degrees, process groups, meshes, ``dims.facts``
    plan: ModelPlan | None  # the model's plan, edited by every plugin; None when no plugin plans it
    device: torch.device  # this rank's device
    modules: list[nn.Module]  # this rank's model parts (its pipeline stages, or the one model)
    forward_module: nn.Module | None  # what the forward calls: a wrapper sets itself here (DDP)
    autocast_dtype: torch.dtype | None  # mixed precision outside FSDP: a wrapper that wants it sets the dtype
    plugin_state: dict[str, Any]  # what a plugin keeps for this model between its hooks, under a name it picks
    stand_in: bool  # True while a runtime runs the model on stand-in inputs (a pipeline's shape inference)
    loss_head: LossHead  # how the loss comes out of the forward: a stage that computes it there sets its own

    @property
    def config(self) -> ParallelConfig:
        """The resolved layout (``dims.config``)."""

    @property
    def mesh(self) -> DeviceMesh:
        """The layout's whole device mesh."""

    def sub_mesh(self, names: str | tuple[str, ...]) -> DeviceMesh | None:
        """The mesh over ``names`` (flattened), or None when all have degree 1."""

    def claim_grad_reduction(self, *axes: str, view: str | None = None, divisor: float | None = None) -> None:
        """Say that the calling wrapper averages gradients over ``axes`` (of mesh ``view``) itself."""

    def on_forward_only(self, release: Callable[[list[nn.Module]], None]) -> None:
        """Have ``release(modules)`` called after a forward that no backward follows (FSDP2's gathers freed)."""

    def release_gathered(self, modules: list[nn.Module]) -> None:
        """Call every ``on_forward_only`` release: a runtime that ran ``modules`` forward only says so."""

    def view_modules(self, model: nn.Module) -> dict[str, str]:
        """{module FQN: mesh view} for the modules of ``model`` the plan puts in a view."""

    def materialize(self) -> None:
        """Give a meta-device model's parameters storage and values now (once): a transform that needs them."""

    def plan_layers(self, model: nn.Module) -> list[str]:
        """The decoder layers present in ``model`` (a pipeline stage holds only some), in the plan's order."""


class TokenAccounting(Protocol):
    """What ``ParallelModel.tokens`` (``core.tokens.TokenAccounting``) offers a plugin: the token counts and loss
    reductions of the loss-scale rule."""

    group: Any  # the process group of the ranks holding different tokens of the global batch; None: one rank

    def global_count(self, targets: torch.Tensor) -> torch.Tensor:
        """The valid target tokens over every rank holding different tokens."""

    def sum_over_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a small CPU tensor) summed over the ranks holding different rows."""

    def loss_share(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global-mean loss, whose gradient after the averaging is the mean's."""

    def reduce_loss(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The global-mean loss, the same on every rank, from this rank's token-loss sum."""

    def add_terms(self, loss_sum: torch.Tensor, terms: list[torch.Tensor], count: torch.Tensor) -> torch.Tensor:
        """``loss_sum`` with the loss parts' ``terms`` folded in, each counted once in value and gradient."""


class TrainerOutputs(Protocol):
    """What ``ParallelModel.outputs`` (``core.outputs.TrainerOutputs``) offers a plugin's runtime: the forward's
    targets, the loss sum and the extra terms, through the model's loss head and the plugins' hooks."""

    objective: Callable[..., torch.Tensor] | None  # a trainer's own loss, run where the loss runs; None: the default

    def forward_targets(self, targets: torch.Tensor, per_token: bool = False) -> AbstractContextManager:
        """Where one micro-batch's forward runs: the loss head given its targets (``LossHead.targets``)."""

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's token-loss sum of one micro-batch (the loss head's, else the cross-entropy)."""

    def loss_terms(self, output: Any, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The plugins' extra terms of this micro-batch's loss (each ``ultrascale_step_loss`` part's ``terms``)."""


class GradientReductions(Protocol):
    """What ``ParallelModel.gradients`` (``core.gradients.GradientReductions``) offers a plugin: the averaging the
    engine does itself after the backward."""

    consumed: str  # why the gradients are gone when the backward ends ("" when they are kept): clipping refuses

    @property
    def unclaimed_axes(self) -> list[str]:
        """The gradient axes the engine averages after the backward (no wrapper reduced them)."""


class ParallelModel(Protocol):
    """What the engine's parallel model (``core.parallel_model.ParallelModel``) offers a plugin in the step,
    state and runtime hooks: the model, its context and layout, the step's pieces."""

    module: nn.Module  # the model as given (sharded in place)
    ctx: ParallelContext  # the context the model was transformed in
    config: ParallelConfig  # the resolved layout
    dims: ParallelDims  # the layout's degrees, groups and facts
    pm: pluggy.PluginManager  # the plugin manager the model's hooks run through
    runtime: Runtime  # how this rank's model parts run a step (a pipeline's schedule)
    forward_module: nn.Module  # what the forward calls (a DDP wrapper, or the model)
    tokens: TokenAccounting  # token counts and loss reductions
    outputs: TrainerOutputs  # the forward's targets, loss sum and extra terms
    gradients: GradientReductions  # the engine's own gradient averaging

    @property
    def modules(self) -> list[nn.Module]:
        """This rank's model parts: its pipeline stages, or the whole (sharded) model."""

    def prepare_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's inputs and shifted ``targets`` on the device, every ``ultrascale_step_shard_batch`` applied."""

    def autocast(self) -> AbstractContextManager:
        """Mixed precision outside FSDP (``ctx.autocast_dtype``), or nothing."""

    def loss_context(self) -> AbstractContextManager:
        """Where the loss and its backward run: each ``ultrascale_step_loss`` part's ``context`` entered."""

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        """The model's output on this rank's batch, with ``loss`` (global-mean value, this rank's gradient)."""

    def backward(self, loss: torch.Tensor, backward_fn: Callable[[torch.Tensor], None] | None = None) -> None:
        """Backward of ``loss`` inside the loss context, then ``finish_backward``."""

    def finish_backward(self) -> None:
        """After a backward that completes the gradients: the engine's averaging and the after-backward hooks."""


class PluginState(Protocol):
    """What the engine's plugin state (``core.plugin_state.PluginState``, filled by ``ParallelModel.state_dict``
    and the sharded checkpoints) offers a plugin's ``ultrascale_state_save`` / ``ultrascale_state_load``."""

    shared: dict[str, Any]  # what every rank holds alike: tensors into the sharded files, the rest into JSON
    rank_local: dict[str, Any]  # what differs per rank: restored only in the same world size
    left_out: set[str]  # model entries (unparallelized names) kept out of the checkpoint: the caller supplies them
    loading: dict[str, Any] | None  # on a load, the checkpoint's metadata (``ultrascale.json``); None on a save


class SavedCheckpoint(Protocol):
    """What a sharded checkpoint (``checkpoints.export.SavedCheckpoint``) offers a ``WrapperLibrary.export``."""

    path: Path  # the checkpoint's directory
    meta: dict[str, Any]  # its metadata (``ultrascale.json``)
    config: PretrainedConfig  # the transformers config its model was saved with
    names: list[str]  # the model tensors it holds, sorted

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Those tensors, whole, on the CPU (every rank's shards gathered, in this one process)."""

"""The engine: ``parallelize(model, config)`` checks the layout, builds the mesh, composes the dimensions'
transforms in one fixed order and returns a ``ParallelModel``, whose forward / backward / step every front end
calls (the CLI through ``train_step``, Lightning and Accelerate through ``hf_module.ParallelCausalLM``)."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed import launch
from ..distributed.comm_ledger import CommLedger, GroupLabels, last_record_id
from ..distributed.grad_norm import clip_grad_norm_
from ..distributed.loss import IGNORE_INDEX, shifted_targets, token_loss_sum, valid_token_counts
from ..interface.config import ConfigError, ParallelConfig
from ..interface.estimates import Estimate, Shape, inventory, meta_model
from ..models.plan import ModelPlan, layers_present
from ..interface.parallel_dims import ParallelDims, resolve
from ..interface.plugins import get_plugin_manager
from ..interface.runtime import Runtime
from ..interface.stages import collect_stages, describe_stages, order_stages
from .comm_report import StepProfile
from ..interface.model_wrapper import wrapper_of


@dataclasses.dataclass
class ParallelContext:
    """What the plugins see while transforming: the layout, the plan, the device, this rank's model parts."""

    dims: ParallelDims
    plan: ModelPlan | None
    device: torch.device
    modules: list = dataclasses.field(default_factory=list)  # this rank's model parts (pipeline stages, or one)
    runtime: Runtime = dataclasses.field(default_factory=Runtime)  # how the parts run a step
    forward_module: nn.Module | None = None  # what the forward calls (a DDP wrapper, or the model itself)
    autocast_dtype: torch.dtype | None = None  # mixed precision outside FSDP
    claimed_axes: set = dataclasses.field(default_factory=set)  # gradient-averaging axes a wrapper handles
    # the same for the modules in a mesh view: view -> (axes a wrapper reduces, the divisor it applies)
    view_claims: dict = dataclasses.field(default_factory=dict)
    # what a dimension keeps for this model between its hooks (e.g. context parallel's group and batch flags),
    # keyed by a name the plugin chooses
    plugin_state: dict = dataclasses.field(default_factory=dict)
    # True while a runtime runs the model on stand-in inputs (a pipeline's shape inference): a plugin that keeps
    # statistics of the real batches leaves these forwards out
    stand_in: bool = False
    # what wrappers free after a forward that no backward follows (FSDP2's gathered parameters): each is called
    # with the modules that ran, by ``release_gathered``
    releases: list = dataclasses.field(default_factory=list)

    _materializer: Any = None

    @property
    def config(self) -> ParallelConfig:
        return self.dims.config

    @property
    def mesh(self):
        return self.dims.mesh

    def sub_mesh(self, names):
        return self.dims.sub_mesh(names)

    def claim_grad_reduction(self, *axes: str, view: str | None = None, divisor: float | None = None) -> None:
        """The calling wrapper averages gradients over ``axes`` itself (FSDP, DDP); the engine averages the
        gradient axes nobody claims. For the modules the plan puts in a mesh ``view`` (``ModelPlan.views``): the
        wrapper sums their gradients over ``axes`` of that view and divides them by ``divisor`` (default: the
        product of the axes' degrees); the engine sums over the view's other gradient axes and divides by what is
        left of the layout's loss scale (``ParallelDims.grad_scale``)."""
        if view is None:
            self.claimed_axes.update(axes)
            return
        claimed, applied = self.view_claims.get(view, (set(), 1.0))
        if set(axes) <= claimed:
            return  # claimed already (one wrapper per module of the view claims the same axes)
        applied *= divisor if divisor is not None else math.prod(self.dims.degree(a) for a in axes)
        self.view_claims[view] = (claimed | set(axes), applied)

    def on_forward_only(self, release) -> None:
        """Have ``release(modules)`` called after a forward-only pass over ``modules`` (once per function): a
        wrapper that gathers parameters for the forward and frees them in the backward frees them there."""
        if release not in self.releases:
            self.releases.append(release)

    def release_gathered(self, modules: list[nn.Module]) -> None:
        """A runtime that ran ``modules`` forward with no backward to follow calls this."""
        for release in self.releases:
            release(modules)

    def view_modules(self, model: nn.Module) -> dict[str, str]:
        """{module FQN in ``model``: mesh view} for the modules of ``model`` the plan puts in a view."""
        if self.plan is None or not self.plan.views:
            return {}
        present = {fqn for fqn, _ in model.named_modules()}
        return {fqn: view for fqn, view in self.plan.views.items() if fqn in present}

    @property
    def param_device(self) -> torch.device:
        """Where this rank's parameters are held: the host when a dimension keeps them there (``params_on_host``:
        offloaded FSDP2 shards), else ``device``. Buffers stay on ``device``."""
        return torch.device("cpu") if self.dims.facts.params_on_host else self.device

    def materialize(self) -> None:
        """Give a meta-device model's parameters storage and their values, in their layout at this point (once).
        The engine calls it after the last transform; a transform that needs real tensors (DDP broadcasts them
        when it wraps the model) calls it first."""
        if self._materializer is not None:
            load, self._materializer = self._materializer, None
            load()

    def plan_layers(self, model: nn.Module) -> list[str]:
        """The decoder layers present in ``model`` (a pipeline stage holds only some)."""
        return layers_present(model, self.plan)


def to_devices(model: nn.Module, param_device, buffer_device) -> None:
    """``model.to(buffer_device)``, its parameters on ``param_device`` (the host, when they are offloaded: FSDP2
    takes them from there)."""
    model.to(param_device)
    if param_device != buffer_device:
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.to(buffer_device)


def model_plan(model: nn.Module, config: ParallelConfig, pm=None) -> ModelPlan | None:
    """The plugins' ``ModelPlan`` for ``model``, found through a wrapper (``ultrascale_model_wrapper``) and named
    from ``model``'s root. Every place that needs the plan asks here."""
    pm = pm or get_plugin_manager()
    wrapper = wrapper_of(model, pm)
    if wrapper.wraps:
        plan = pm.hook.ultrascale_model_plan(model=wrapper.inner, config=config)
        plan = plan.rerooted(wrapper.prefix) if plan is not None else None
    else:
        plan = pm.hook.ultrascale_model_plan(model=model, config=config)
    if plan is None:
        return None
    edits = [e for e in pm.hook.ultrascale_extend_plan(model=model, plan=plan, config=config) if e is not None]
    return plan.edited(model, edits) if edits else plan


def causal_lm_of(obj, pm=None):
    """The Hugging Face causal LM ``obj`` is, or wraps (a plugin's ``ultrascale_model_wrapper``: a PEFT model), or
    None: what the front ends hand to ``parallelize``."""
    from transformers import PreTrainedModel

    if not isinstance(obj, nn.Module):
        return None
    inner = wrapper_of(obj, pm).inner
    return inner if isinstance(inner, PreTrainedModel) and hasattr(inner, "lm_head") else None


def as_config(config: ParallelConfig | dict | None) -> ParallelConfig:
    if config is None:
        return ParallelConfig()
    return ParallelConfig.from_dict(config) if isinstance(config, dict) else config


def validate(config: ParallelConfig, model_config: Any, world_size: int, pm=None, model=None) -> ParallelConfig:
    """Every check that needs no process group: degrees vs world size, vs the model, and each plugin's own;
    with ``model`` (real or on the meta device) also the checks on its module tree and plan.
    Returns the resolved config (the ``-1`` degree filled in).

    The module-tree checks (meta-device dry runs) are skipped only in a worker that ``ultrascale train`` started
    after running them itself on the same layout, world size, model and plugins (``VALIDATED_ENV`` holds their
    ``validated_fingerprint``); a process started any other way runs them all."""
    pm = pm or get_plugin_manager()
    config = as_config(config)
    chosen = pm.hook.ultrascale_resolve_layout(config=config, model_config=model_config, world_size=world_size)
    resolved = resolve(chosen if chosen is not None else config, world_size, pm)
    pm.hook.ultrascale_validate_config(config=resolved, model_config=model_config, world_size=world_size)
    order_stages(collect_stages(pm, resolved, model_config))  # a cycle or an unknown stage name, before any group
    if model is not None and not _validated_by_launcher(resolved, world_size, model, pm):
        plan = model_plan(model, resolved, pm)
        pm.hook.ultrascale_validate_model(model=model, plan=plan, config=resolved)
    return resolved


def validate_loop(config: ParallelConfig, micro_batches: int, max_grad_norm: float | None, pm=None) -> None:
    """The checks of the training loop a front end will run with this layout (``ultrascale_validate_loop``):
    ``micro_batches`` per optimizer step, gradients clipped to ``max_grad_norm`` (None or 0: not clipped)."""
    pm = pm or get_plugin_manager()
    pm.hook.ultrascale_validate_loop(config=as_config(config), micro_batches=int(micro_batches),
                                     max_grad_norm=max_grad_norm or None)


VALIDATED_ENV = "ULTRASCALE_VALIDATED"


def validated_fingerprint(resolved: ParallelConfig, world_size: int, model, pm=None) -> str:
    """A digest of everything the module-tree checks of ``validate`` depend on: the resolved layout, the world
    size, the model's class and full config, the registered plugins and their versions, and the versions of this
    package, torch and transformers. ``ultrascale train`` hands it to the workers it starts (``VALIDATED_ENV``)
    after the same checks passed before launch, so each worker does not repeat them."""
    import hashlib
    import json

    import transformers

    from .. import __version__

    pm = pm or get_plugin_manager()
    dists = {id(plugin): f"{dist.project_name}=={dist.version}" for plugin, dist in pm.list_plugin_distinfo()}
    plugins = sorted(f"{name}:{dists.get(id(plugin), 'builtin')}" for name, plugin in pm.list_name_plugin()
                     if plugin is not None)
    cls = type(model)
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}  # where it was read from
    what = {"layout": resolved.to_dict(), "world_size": world_size, "model": f"{cls.__module__}.{cls.__qualname__}",
            "config": config, "plugins": plugins,
            "versions": [__version__, torch.__version__, transformers.__version__]}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()


def _validated_by_launcher(resolved: ParallelConfig, world_size: int, model, pm) -> bool:
    import os

    marker = os.environ.get(VALIDATED_ENV)
    if not marker:
        return False
    try:
        return marker == validated_fingerprint(resolved, world_size, model, pm)
    except Exception:  # noqa: BLE001 - a model whose config does not serialize: run the checks
        return False


def stages(config: ParallelConfig, model_config: Any, *, world_size: int, pm=None) -> list:
    """The model transforms ``parallelize`` applies for this layout, in their resolved order
    (``interface.stages.Stage``; inactive ones included, marked so)."""
    pm = pm or get_plugin_manager()
    resolved = validate(config, model_config, world_size, pm)
    return order_stages(collect_stages(pm, resolved, model_config))


def describe(config: ParallelConfig | dict, model_config: Any, *, world_size: int | None = None, model=None,
             pm=None) -> str:
    """The stages ``parallelize`` applies for this layout, in order, one line each: name, mesh axes, what it does
    to the model and the plugin it comes from. ``world_size``: default, the product of the layout's degrees.
    ``model``: the model to be parallelized, when it wraps the causal LM (a PEFT model): a first line says what
    its wrapper (``ultrascale_model_wrapper``) is and how its modules go through the stages."""
    config = as_config(config)
    if world_size is None:
        world_size = math.prod(max(a.degree, 1) for a in ParallelDims(config).axes)
    text = describe_stages(stages(config, model_config, world_size=world_size, pm=pm))
    wrapper = wrapper_of(model, pm) if model is not None else None
    if wrapper is not None and wrapper.wraps:
        text = f" 0. the model: {wrapper.describe()}  ({type(wrapper).__module__})\n" + text
    return text


def estimate(config: ParallelConfig, model_config: Any, *, world_size: int, seq_len: int = 2048,
             micro_batch: int = 1, micro_batches: int = 1, coords: dict | None = None, model=None,
             profile: str = "ultrascale", optimizer: str = "adamw", check: bool = True, pm=None, plan=None,
             **constants):
    """Per-rank memory by category, communication terms per mesh axis and compute factors (an
    ``estimates.Estimate``), each contributed by its dimension's plugin through ``ultrascale_estimate``.

    ``coords`` picks the rank ({axis: index}; an axis left out: the most loaded rank along it). ``model`` (real or
    on the meta device) gives the exact parameter inventory; without it the model is built from ``model_config``
    on the meta device (``plan``: its model plan, when the caller has it). ``check=False`` costs layouts this
    engine cannot run (the planner's "runnable: false")."""
    return estimate_with_shape(config, model_config, world_size=world_size, seq_len=seq_len, micro_batch=micro_batch,
                               micro_batches=micro_batches, coords=coords, model=model, profile=profile,
                               optimizer=optimizer, check=check, pm=pm, plan=plan, **constants)[0]


def estimate_with_shape(config: ParallelConfig, model_config: Any, *, world_size: int, seq_len: int = 2048,
                        micro_batch: int = 1, micro_batches: int = 1, coords: dict | None = None, model=None,
                        profile: str = "ultrascale", optimizer: str = "adamw", check: bool = True, pm=None, plan=None,
                        **constants):
    """``estimate``, and the ``Shape`` as the dimensions left it (the inventory cut to this rank's share, the
    pipeline's layers): what the layout's communication minimum (``comm_minimum``) is computed from."""
    pm = pm or get_plugin_manager()
    resolved = validate(config, model_config, world_size, pm) if check else resolve(as_config(config), world_size,
                                                                                      pm, check=False)
    if model is None:
        model = meta_model(model_config)
    if plan is None:
        plan = model_plan(model, resolved, pm)
    shape = Shape(model_config=model_config, seq_len=seq_len, micro_batch=micro_batch, micro_batches=micro_batches,
                  profile=profile, optimizer=optimizer, coords=dict(coords or {}), inventory=inventory(model, plan),
                  model=model, plan=plan, **constants)
    est = Estimate(micro_batches=micro_batches)
    pm.hook.ultrascale_estimate(config=resolved, model_config=model_config, shape=shape, estimate=est)
    return est, shape


def pin_hub_kernels(model: nn.Module) -> None:
    """Choose a Hugging Face model's hub kernels once, for training, before the dimensions wrap its modules.

    Why: with the ``kernels`` package installed, transformers loads a model with hub kernels on (``use_kernels``,
    ``from_pretrained``'s default) and kernelizes it again whenever ``train()`` / ``eval()`` changes its mode, which
    resets the forwards of its kernel layers (RMSNorm, ...) and with them the forwards the dimensions put there
    (sequence parallel's norms: the step failed, 'mixed torch.Tensor and DTensor', on the first ``train()`` of a
    model loaded in eval mode). The model keeps the training-mode kernels (they have a backward), and its mode."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and getattr(module, "use_kernels", False):
            training = module.training
            module.train()  # kernelized for training now, if it was not
            module._use_kernels = False  # no kernelization on later mode changes (transformers' own flag)
            module.train(training)


def parallelize(model: nn.Module, config: ParallelConfig | dict | None = None, *, device=None,
                init_from: str | None = None, init_weights=None) -> "ParallelModel":
    """Shard ``model`` (a Hugging Face causal LM) over the current process group according to ``config``.

    ``init_from``: a Hugging Face directory whose weights the model takes, each rank reading only its own shards
    (what the files do not hold, a PEFT model's adapters, is drawn from the seed; rank 0 warns of keys the model
    does not use). ``model`` may live on the meta device (built under ``torch.device("meta")``): then every rank
    gives only its own shards storage and values once the layout is final — from ``init_from``, else from
    ``init_weights`` (an object with ``load(ctx, buffers)``, e.g. ``pretrained.PretrainedWeights``), else from the
    directory its config was read from, else with the model's own initialization — so no rank ever holds the
    whole model. The command line, Lightning, Accelerate and the Trainer all build their model here."""
    pm = get_plugin_manager()
    config = validate(as_config(config), model.config, launch.world_size(), pm, model=model)  # no group yet
    if init_weights is None and (init_from is not None or any(p.is_meta for p in model.parameters())):
        from ..checkpoints.pretrained import weights_for

        init_weights = weights_for(model, init_from)
        if init_from is not None:
            warn_unused(init_from, init_weights.unexpected)
    if device is None:
        device = launch.init_distributed()
    elif not dist.is_initialized():
        launch.init_distributed()
    dims = ParallelDims(config, launch.world_size(), pm)
    dims.build_mesh(device.type)
    ctx = ParallelContext(dims=dims, plan=model_plan(model, config, pm), device=device,
                          modules=[model])
    if init_weights is not None:  # the weights replace whatever the parameters hold now
        buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if not buf.is_meta}
        ctx._materializer = lambda: init_weights.load(ctx, buffers)
    else:
        to_devices(model, ctx.param_device, device)

    pin_hub_kernels(model)
    # the named stages, in the order their declarations give (interface.stages): split (this rank's pipeline
    # stages and their runtime), float8, ep, tp + sp, cp, ac, compile, dp, and any plugin's among them
    for stage in order_stages(collect_stages(pm, config, model.config)):
        if not stage.active:
            continue
        if stage.splits:
            split = stage.run(model, ctx)
            if split is not None:
                ctx.modules, ctx.runtime = split
            continue
        for part in ctx.modules:
            stage.run(part, ctx)
    ctx.materialize()
    if any(part is not model for part in ctx.modules):
        release_unheld(model, ctx.modules)
    return ParallelModel(model, ctx, pm)


def release_unheld(model: nn.Module, parts: list[nn.Module]) -> None:
    """Move to the meta device every parameter of ``model`` whose storage none of ``parts`` holds: a pipeline
    rank's stages are copies of the model (then sharded by TP and FSDP into storage of their own), and the model
    as given would otherwise keep every other stage's weights, and its own unsharded ones, for the whole run. Names,
    shapes and ``requires_grad`` stay (the front ends and checkpoints read them); a weight shared by several
    modules stays shared."""
    from torch.distributed.tensor import DTensor

    held = set()
    for part in parts:
        for tensor in part.parameters():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if not local.is_meta and local.numel():
                held.add(local.untyped_storage().data_ptr())
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.is_meta or isinstance(param, DTensor) or not param.numel():
                continue
            if id(param) not in replaced:
                if param.untyped_storage().data_ptr() in held:
                    continue
                replaced[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
            module._parameters[name] = replaced[id(param)]


def from_pretrained(path, config: ParallelConfig | dict | None = None, *, device=None,
                    trust_remote_code: bool = False) -> "ParallelModel":
    """Build the model of the Hugging Face directory ``path`` in the layout ``config`` and load its weights, each
    rank reading only its own shards (``pretrained``: names, tied weights and shapes are checked before any process
    group exists)."""
    from ..checkpoints.pretrained import prepare

    weights, model = prepare(path, trust_remote_code=trust_remote_code)
    warn_unused(path, weights.unexpected)
    return parallelize(model, config, device=device, init_weights=weights)


def warn_unused(path, unexpected: list[str]) -> None:
    """Rank 0's warning of the keys in a pretrained directory's files that the model does not read."""
    if unexpected and launch.global_rank() == 0:
        warnings.warn(f"'{path}': {len(unexpected)} key(s) in the files are not used by the model: "
                      f"{', '.join(unexpected[:8])}", stacklevel=3)


class ParallelModel:
    """A parallelized model and its training step. ``module`` is the Hugging Face model (sharded in place)."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, pm):
        self.module = module
        self.ctx = ctx
        self.dims = ctx.dims
        self.config = ctx.config
        self.pm = pm
        self.runtime = ctx.runtime
        self.forward_module = ctx.forward_module or module
        self.device = ctx.device
        rows = self.dims.sub_mesh(self.dims.row_axes)
        self.data_parallel_size = self.dims.dp
        self.data_parallel_rank = rows.get_local_rank() if rows is not None else 0
        self._token_group = self.dims.group(self.dims.token_axes)
        self._grad_reductions = self._gradient_reductions()
        self.grad_sync = True  # False inside no_sync()
        # why the gradients are gone once the backward ends (a plugin that steps the optimizer inside it sets it):
        # clipping to a global norm is then refused, not computed over nothing
        self.gradients_consumed = ""
        self._profile = None  # the step being recorded (profile_step), which notes the batches
        self.objective = None  # a trainer's own loss, run where the loss runs (with_objective)

    def _gradient_reductions(self) -> list[tuple[list, Any, float]]:
        """(parameters, process group or None, divisor) per group of parameters whose gradients the engine still
        reduces: the layout's gradient axes no wrapper claimed (an average), and for each mesh view the plan puts
        modules in, the view's unclaimed gradient axes (a sum) and what is left of the loss scale."""
        in_view: dict[int, str] = {}
        for part in self.modules:
            for fqn, view in self.ctx.view_modules(part).items():
                for param in part.get_submodule(fqn).parameters():
                    in_view[id(param)] = view
        groups: dict[str | None, list] = {}
        for param in self.parameters():
            groups.setdefault(in_view.get(id(param)), []).append(param)
        out = []
        for view, params in groups.items():
            if view is None:
                mesh = self.dims.sub_mesh(tuple(a for a in self.dims.grad_axes if a not in self.ctx.claimed_axes))
                if mesh is not None:
                    out.append((params, mesh.get_group(), float(mesh.size())))
                continue
            claimed, applied = self.ctx.view_claims.get(view, (set(), 1.0))
            rest = tuple(a for a in self.dims.view_grad_axes(view) if a not in claimed)
            mesh = self.dims.sub_mesh(tuple(a for a in rest if self.dims.degree(a) > 1), view=view)
            divisor = self.dims.grad_scale / applied
            if mesh is not None or divisor != 1:
                out.append((params, mesh.get_group() if mesh is not None else None, divisor))
        return out

    @property
    def unclaimed_gradient_axes(self) -> list[str]:
        """The gradient axes whose averaging the engine does after the backward (no wrapper reduced them inside
        it), a mesh view's as ``view:axis``; empty when every gradient is final when its backward ends."""
        if not self._grad_reductions:
            return []
        out = [a for a in self.dims.grad_axes if a not in self.ctx.claimed_axes]
        for view in self.dims.views:
            claimed, _ = self.ctx.view_claims.get(view, (set(), 1.0))
            out += [f"{view}:{a}" for a in self.dims.view_grad_axes(view)
                    if a not in claimed and self.dims.degree(a) > 1]
        return out or ["the loss scale's division"]

    # ---- what users call -------------------------------------------------------------------------
    @property
    def modules(self) -> list[nn.Module]:
        """This rank's parts of the model: its pipeline stages, or the whole (sharded) model."""
        return self.ctx.modules

    def parameters(self) -> Iterable[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()

    def named_parameters(self):
        for module in self.modules:
            yield from module.named_parameters()

    @property
    def pipeline_stats(self) -> dict | None:
        """With pp > 1: this rank's last training step as ``{step_s, busy_s, idle_fraction}`` (idle = pipeline
        bubble plus waiting on communication)."""
        return self.runtime.stats

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to train with, for an optimizer over this model's (sharded) parameters: the layout's
        plugins may replace it (ZeRO-1 partitions its states over data parallel). Every front end's optimizer
        comes through here."""
        replaced = self.pm.hook.ultrascale_prepare_optimizer(pmodel=self, optimizer=optimizer)
        return replaced if replaced is not None else optimizer

    def build_optimizer(self, optimizer_cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
        return self.prepare_optimizer(optimizer_cls(list(self.parameters()), **kwargs))

    def train_step(self, batch: dict, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward on this rank's share of the global batch; returns the global-mean loss.
        Gradients are those of ``loss_scale`` x that loss, added to any already there."""
        for module in self.modules:
            module.train()
        return self.pm.hook.ultrascale_train_step(pmodel=self, batch=batch, loss_scale=loss_scale)

    @torch.no_grad()
    def eval_step(self, batch: dict) -> torch.Tensor:
        """Validation loss of the global batch (``model.eval()`` semantics: no dropout)."""
        return self.runtime.eval_step(self, batch)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no data-parallel reduction, no tied-weight sums); the first backward
        after the block synchronises everything accumulated. For gradient accumulation. Each dimension's
        wrappers stop reducing through ``ultrascale_no_sync``."""
        self.grad_sync = False
        try:
            with contextlib.ExitStack() as stack:
                for context in self.pm.hook.ultrascale_no_sync(pmodel=self):
                    if context is not None:
                        stack.enter_context(context)
                yield
        finally:
            self.grad_sync = True

    def __call__(self, *args, **kwargs):
        return self.forward_module(*args, **kwargs)

    @contextlib.contextmanager
    def profile_step(self, out=print):
        """Record every collective this rank issues inside the block, meant to hold one optimizer step as the
        loop runs it (its ``train_step`` calls, ``no_sync``, ``clip_grad_norm_``, ``optimizer.step()``), then
        gather every rank's record and set it out per mesh axis and operation beside the package's estimate for
        the same step and the layout's minimum (``comm_report``). Every rank must run the block. Yields a
        ``comm_report.StepProfile``, whose ``table`` (text) and ``rows`` are filled when the block ends; rank 0
        hands the table to ``out`` (None: nothing printed). Nothing it records changes what runs."""
        profile = StepProfile(self)
        labels = GroupLabels(self.meshes)
        after = last_record_id()  # the flight recorder's last entry, when it is on (the independent count)
        self._profile = profile
        try:
            with CommLedger(labels) as ledger:
                yield profile
        finally:
            self._profile = None
        profile.finish(ledger.records, labels, after, out)

    def meshes(self) -> list:
        """The device meshes of this model's layout: the layout's and each mesh view's."""
        return [self.dims.mesh, *self.dims.view_meshes.values()]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of all gradients of the unsharded model (DTensor/sharded gradients included)."""
        if self.gradients_consumed:
            if math.isinf(max_norm):  # only the norm, to log it (the Trainer asks every step): there is none
                return torch.tensor(float("nan"))
            raise ConfigError(f"gradient clipping: {self.gradients_consumed}, so there is no global norm to clip "
                              "to. Fix: turn clipping off (max_grad_norm: 0)")
        params = list(self.parameters())
        return clip_grad_norm_(self.runtime.norm_parameters(params), max_norm, norm_type,
                               group=self.runtime.norm_group(), clip=params)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the training state: ``{"model": ...}`` (DTensors where sharded, the unparallelized
        model's parameter names), the layout, and what each dimension adds through ``ultrascale_state_dict``."""
        model_state: dict[str, Any] = {}
        for module in self.modules:
            model_state.update(module.state_dict())
        # torch.distributed.checkpoint takes over a second to import: only for a run that saves
        from ..checkpoints.sharded import PluginState

        plugins = PluginState()
        self.pm.hook.ultrascale_state_dict(pmodel=self, state=plugins)
        return {"model": model_state, "config": self.config.to_dict(), "plugins": plugins}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by ``state_dict`` in the same layout."""
        saved, current = state.get("config"), self.config.to_dict()
        if saved is not None and saved != current:
            diff = {k: (v, current.get(k)) for k, v in saved.items() if current.get(k) != v}
            raise ConfigError(f"state was saved in another layout (saved vs current: {diff}). Fix: load it in the "
                              "layout it was saved in")
        for module in self.modules:
            own = module.state_dict().keys()
            module.load_state_dict({k: v for k, v in state["model"].items() if k in own})
        if state.get("plugins") is not None:
            self.pm.hook.ultrascale_load_state_dict(pmodel=self, state=state["plugins"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, gathered to full CPU tensors on every rank (for checks and export)."""
        out, wrapper = {}, wrapper_of(self.module, self.pm)  # a wrapper's tensor subclasses gather its own way
        for module in self.modules:
            for name, tensor in module.state_dict().items():
                out[name] = wrapper.whole_value(tensor).detach().cpu().clone()
        return self.runtime.gather_full_state(out)

    # ---- the step's pieces: the built-in step, the pipeline runtime and the front ends use these --------
    def to_device(self, batch: dict) -> dict:
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def prepare_batch(self, batch: dict) -> dict:
        """This rank's inputs and next-token ``targets`` on the device: the data loader's rows, then each
        dimension's part of them (``ultrascale_shard_batch``). Targets are shifted before any plugin splits the
        sequence, so the token after a split point stays the target of the one before it."""
        batch = self.to_device(batch)
        if self._profile is not None:
            self._profile.saw_batch(batch)
        out = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if batch.get(k) is not None}
        out["targets"] = shifted_targets(batch)
        self.pm.hook.ultrascale_shard_batch(batch=out, ctx=self.ctx)
        return {k: v.contiguous() for k, v in out.items()}  # a strided split would reach collectives as a view

    def global_token_count(self, targets: torch.Tensor) -> torch.Tensor:
        """Valid target tokens over every rank that holds different tokens (the ``counts_tokens`` axes)."""
        count = (targets != IGNORE_INDEX).sum().to(torch.float64)
        if self._token_group is not None:
            dist.all_reduce(count, group=self._token_group)
        return count.clamp_min(1)

    def sum_over_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a small tensor) summed over the ranks that hold different tokens of the global batch (the
        data-parallel and context-parallel axes: the ``counts_tokens`` ones), on the CPU."""
        if self._token_group is None:
            return values.detach().cpu()
        out = values.detach().to(self.device)
        dist.all_reduce(out, group=self._token_group)
        return out.cpu()

    def sum_over_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a small CPU tensor) summed over the ranks that hold different rows (the data-parallel axes)."""
        group = self.dims.group(self.dims.row_axes)
        if group is None:
            return values
        out = values.to(self.device)
        dist.all_reduce(out, group=group)
        return out.cpu()

    @property
    def microbatches_inside(self) -> int:
        """How many micro-batches one ``train_step`` call runs inside the model (a pipeline schedule's, from the
        ``ultrascale_microbatches`` hook); 1 when each call is one micro-batch."""
        return self.pm.hook.ultrascale_microbatches(config=self.config) or 1

    def token_shares(self, chunks: list[dict]) -> list[float]:
        """Each micro-batch's share of the valid target tokens of a whole optimizer step on all data-parallel
        ranks (one small all-reduce over the ranks that hold different rows); one micro-batch: 1. Weighting
        each micro-batch's global-mean loss by its share (``train_step(..., loss_scale=share)``) makes the sum
        exactly the step's global token mean, in value and gradient, however unevenly padding falls."""
        if len(chunks) == 1:
            return [1.0]
        counts = self.sum_over_rows(valid_token_counts(chunks))
        total = float(counts.sum())
        return [float(c) / total if total else 1.0 / len(chunks) for c in counts]

    def autocast(self):
        dtype = self.ctx.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    @contextlib.contextmanager
    def loss_context(self):
        """Where the loss and its backward run: every plugin's ``ultrascale_loss_context`` entered."""
        with contextlib.ExitStack() as stack:
            for context in self.pm.hook.ultrascale_loss_context(pmodel=self):
                if context is not None:
                    stack.enter_context(context)
            yield

    @contextlib.contextmanager
    def forward_targets(self, targets: torch.Tensor, per_token: bool = False):
        """Where one micro-batch's forward runs: every plugin's ``ultrascale_forward_targets`` entered with its
        targets (a loss computed inside the forward reads them; ``per_token``: each token's figures wanted)."""
        with contextlib.ExitStack() as stack:
            for context in self.pm.hook.ultrascale_forward_targets(pmodel=self, targets=targets,
                                                                   per_token=per_token):
                if context is not None:
                    stack.enter_context(context)
            yield

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's token-loss sum of one micro-batch: a plugin's, when the forward computed it
        (``ultrascale_loss_sum``), else the cross-entropy of ``logits`` against ``targets``."""
        computed = self.pm.hook.ultrascale_loss_sum(pmodel=self, logits=logits, targets=targets)
        return computed if computed is not None else token_loss_sum(logits, targets)

    @property
    def token_group(self):
        """The process group of the ranks that hold different tokens of the global batch (None: one rank)."""
        return self._token_group

    def add_loss_terms(self, loss_sum, terms, count: torch.Tensor):
        """``loss_sum`` (this rank's token-loss sum) with the plugins' extra terms (``ultrascale_loss_terms``)
        folded in, so that the loss share's gradient and the reduced loss's value each include every term once:
        the gradient part (term x count) gives the term's gradient after the loss scale and the gradient
        averaging; the value part (term x count / grad_scale) sums to the term over the token-counting ranks."""
        for term in terms:
            grad_part = term * count.to(term.dtype)
            folded = grad_part + (grad_part / self.dims.grad_scale - grad_part).detach()
            if isinstance(loss_sum, DTensor):
                folded = DTensor.from_local(folded, loss_sum.device_mesh, loss_sum.placements, run_check=False)
            loss_sum = loss_sum + folded
        return loss_sum

    def loss_terms(self, output, batch) -> list:
        return [t for terms in self.pm.hook.ultrascale_loss_terms(pmodel=self, output=output, batch=batch)
                if terms for t in terms]

    def loss_share(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The loss-scale rule: this rank's token-loss sum x ``grad_scale`` / global tokens, whose gradient after
        the averaging over the gradient axes is that of the global-mean loss."""
        return loss_sum * (self.dims.grad_scale / count)

    def reduce_loss(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The global-mean loss (same value on every rank) from this rank's token-loss sum."""
        total = loss_sum.detach()
        if isinstance(total, DTensor):
            total = total.full_tensor()
        total = total.to(torch.float64)
        if self._token_group is not None:
            dist.all_reduce(total, group=self._token_group)
        return (total / count).float()

    def forward(self, batch: dict):
        """The model's output on this rank's batch, with ``loss``: its value is the global-mean loss over every
        valid token of the global batch (the same on every rank), its gradient this rank's share of it. Under
        ``torch.no_grad`` the loss is the plain global mean."""
        batch = self.prepare_batch(batch)
        targets = batch.pop("targets")
        count = self.global_token_count(targets)
        with self.autocast(), self.forward_targets(targets):
            output = self.forward_module(**batch, use_cache=False)
        with self.loss_context():
            loss_sum = self.token_loss_sum(output.logits, targets)
        if output.logits is loss_sum:  # the forward computed the loss (the chunked loss): there are no logits
            output.logits = None
        loss_sum = self.add_loss_terms(loss_sum, self.loss_terms(output, batch), count)
        output.loss = self.token_mean(loss_sum, count)
        return output

    def token_mean(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss from this rank's sum of its tokens' losses: its value the global mean over
        ``count`` valid tokens (the same on every rank), its gradient this rank's share (the loss-scale rule), so
        that a front end's backward of it gives exact gradients. Under ``torch.no_grad``: the global mean."""
        mean = self.reduce_loss(loss_sum, count)
        if not torch.is_grad_enabled():
            return mean
        share = self.loss_share(loss_sum, count)
        if isinstance(share, DTensor):  # vocab-parallel loss: a replicated scalar
            share = share.to_local()
        return (share + (mean - share).detach()).float()

    def token_outputs(self, batch: dict, whole_rows: bool = False, **model_kwargs):
        """This rank's tokens of one micro-batch, each with the log-probability of its next-token target (the
        gradient flows), the entropy of its prediction, whether the target is its top-1 and the mean of its logits
        (no gradient), as a ``distributed.loss.TokenOutputs`` with the global valid-token count: what a trainer
        computing its own loss from per-token log-probabilities reads (TRL's fused LM head); ``token_mean`` of its
        losses' sum is the micro-batch's loss. A head computing its loss in chunks gives them without the whole
        logits (``chunked_loss``). Not in a pipeline: its loss runs on the last stage, inside the schedule.

        ``whole_rows``: each of this rank's rows whole instead, as long as the batch's (the figures of the tokens
        other ranks hold, such as context parallel's, gathered without gradient; this rank's keep theirs, and any
        padding a dimension added is dropped), for a loss that is a function of each row's sum (a preference
        loss); ``row_mean`` of a mean over the rows is the micro-batch's loss. ``model_kwargs`` go to the model's
        forward (``output_router_logits``)."""
        from ..distributed.loss import token_outputs_of

        if self.runtime.backward_in_forward:
            raise ConfigError("pp>1: per-token log-probabilities for a trainer's own loss are not available in a "
                              "pipeline (its loss runs on the last stage, inside the schedule). Fix: use pp: 1")
        width = batch["input_ids"].shape[1]
        places = self.token_places(batch) if whole_rows else None  # before the batch's own split
        batch = self.prepare_batch(batch)
        targets = batch.pop("targets")
        count = self.global_token_count(targets)
        with self.autocast(), self.forward_targets(targets, per_token=True):
            output = self.forward_module(**batch, use_cache=False, **model_kwargs)
        with self.loss_context():
            got = self.pm.hook.ultrascale_token_outputs(pmodel=self, logits=output.logits, targets=targets)
            if got is None:
                got = token_outputs_of(output.logits, targets)
        output.logits = None
        got.count, got.output, got.terms = count, output, self.loss_terms(output, batch)
        if not torch.is_grad_enabled():  # no backward frees what the forward gathered (a frozen reference's pass)
            self.ctx.release_gathered(self.modules)
        return self.whole_rows(got, places, width) if whole_rows else got

    def token_places(self, batch: dict) -> torch.Tensor:
        """Where in its row each token this rank will hold sits (-100: padding a dimension adds): every plugin's
        ``ultrascale_shard_batch`` run on the batch with each target replaced by its own position. The plugins
        split by position alone, so the real batch's tokens land where these positions do."""
        rows, seq = batch["input_ids"].shape
        probe = self.to_device({k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")
                                if batch.get(k) is not None})
        probe["targets"] = torch.arange(seq, device=self.device).expand(rows, seq).clone()
        self.pm.hook.ultrascale_shard_batch(batch=probe, ctx=self.ctx)
        return probe["targets"]

    def whole_rows(self, got, places: torch.Tensor, width: int):
        """``got``'s per-token figures put back in their rows, ``width`` tokens each: those of the ranks holding
        other tokens of the same rows (the token-counting axes that do not split rows) all-gathered without
        gradient, this rank's with theirs (its part of every row's sum). ``places``: ``token_places`` of the batch
        (its rows that ``got`` holds)."""
        names = tuple(a for a in self.dims.token_axes if a not in self.dims.row_axes)
        group = self.dims.group(names) if names else None
        fields = ("log_probs", "entropy", "is_top1", "label_mask", "mean_logits")
        local = torch.stack([getattr(got, f).detach().float() for f in fields])
        slot = torch.where(places >= 0, places, width)  # padding goes to a column dropped below
        if group is None:
            parts, spots = [local], [slot]
        else:
            size = dist.get_world_size(group)
            parts = [torch.empty_like(local) for _ in range(size)]
            spots = [torch.empty_like(slot) for _ in range(size)]
            dist.all_gather(parts, local.contiguous(), group=group)
            dist.all_gather(spots, slot.contiguous(), group=group)
        rows = local.shape[1]
        whole = torch.zeros(len(fields), rows, width + 1, device=local.device)
        for part, spot in zip(parts, spots):
            whole.scatter_(2, spot.unsqueeze(0).expand_as(part), part)
        whole = whole[..., :width]
        own = torch.zeros(rows, width + 1, device=local.device, dtype=got.log_probs.dtype)
        own = own.scatter(1, slot, got.log_probs - got.log_probs.detach())[:, :width]  # this rank's gradient path
        got.log_probs = whole[0].to(got.log_probs.dtype) + own
        got.entropy, got.mean_logits = whole[1], whole[4]
        got.is_top1, got.label_mask = whole[2].bool(), whole[3].bool()
        return got

    def row_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss from ``loss``, a mean over this rank's rows of figures of whole rows
        (``token_outputs(whole_rows=True)``: the same value on every rank holding other tokens of those rows,
        each rank's gradient flowing through its own tokens): its value the mean over the data-parallel replicas
        (each holding as many rows), its gradient scaled so that the engine's averaging over the gradient axes
        gives that mean's (the replicas' gradients averaged, the token-splitting ranks' summed). Under
        ``torch.no_grad``: the mean."""
        mean = loss.detach().to(torch.float64)
        group = self.dims.group(self.dims.row_axes)
        if group is not None:
            dist.all_reduce(mean, group=group)
        mean = (mean / self.dims.dp).float()
        if not torch.is_grad_enabled() or not loss.requires_grad:
            return mean
        scaled = loss * (self.dims.grad_scale / self.dims.dp)
        return scaled + (mean - scaled).detach()

    @contextlib.contextmanager
    def with_objective(self, objective):
        """Inside the block, a runtime that computes the loss inside the model call (a pipeline's last stage,
        inside its schedule) computes each micro-batch's as ``objective(chunk, outputs, scale)`` instead of the
        token cross-entropy: ``outputs`` the micro-batch's per-token ``TokenOutputs`` (``token_outputs``'
        contract), ``chunk`` its number in the step (None in a forward-only pass, whose outputs are the whole
        local batch's), ``scale`` the step's token-loss scale (the loss-scale rule of the step's global token count
        and its ``loss_scale``). What it returns is what the schedule differentiates; ``train_step`` and
        ``eval_step`` return the sum of its values over ``scale``, divided by the global token count. For a trainer
        that computes its own loss from per-token log-probabilities (TRL's) in a pipeline."""
        self.objective = objective
        try:
            yield
        finally:
            self.objective = None

    def from_last_stage(self, values):
        """``values`` (a small tensor, or any picklable object, an objective computed where the loss runs) as the
        rank holding the last stage has them, on every rank of the pipeline."""
        return self.runtime.from_last_stage(values)

    def backward(self, loss: torch.Tensor, backward_fn=None) -> None:
        """Backward of ``loss`` (a front end passes its own ``backward_fn``), then ``finish_backward``."""
        with self.loss_context():
            (backward_fn or torch.Tensor.backward)(loss)
        self.finish_backward()

    def finish_backward(self) -> None:
        """After a backward that completes the gradients (not inside ``no_sync``): average them over the
        gradient axes no wrapper reduced, then the runtime's own work (a pipeline's tied weights)."""
        if not self.grad_sync:
            return
        for params, group, divisor in self._grad_reductions:
            average_gradients(params, group, divisor)
        self.runtime.after_backward(self)
        self.pm.hook.ultrascale_after_backward(pmodel=self)


def average_gradients(params, group, size: float) -> None:
    """Sum the (local shards of the) gradients over ``group`` (None: this rank's alone) in one flat all-reduce and
    divide them by ``size`` (the group's size: an average)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in local:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def move_scheduler(scheduler, old, new) -> None:
    """Point an LR scheduler built on ``old`` at ``new`` (the optimizer ``prepare_optimizer`` returned in its
    place), carrying the per-group learning rates the scheduler set up."""
    if getattr(scheduler, "optimizer", None) is not old or new is old:
        return
    for g_new, g_old in zip(new.param_groups, old.param_groups):
        for key in ("lr", "initial_lr"):
            if key in g_old:
                g_new[key] = g_old[key]
    scheduler.optimizer = new

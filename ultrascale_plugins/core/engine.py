"""The engine: ``place(model, config)`` builds the mesh, composes the dimensions' transforms in the order their
stages declare, has the caller's loader give the shards their values and returns a ``ParallelModel``
(``core.parallel_model``), whose step every front end drives; ``us.parallelize`` (``checkpoints.load``) checks the
layout and picks the loader before it. Also the checks that need no process group (``validate``), ``describe`` and
``estimate``."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import launch
from ..interface.config import ParallelConfig
from ..interface.loss_head import LossHead
from ..interface.parallel_dims import ParallelDims
from ..interface.runtime import Runtime
from ..interface.stages import describe_stages, order_stages
from ..interface.training_loop import TrainingLoop
from ..models.plan import ModelPlan, layers_present
from .costing import resolved_cost
from .parallel_model import ParallelModel
from .plans import model_plan


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
    # how the loss comes out of the forward: the engine's own (from the whole logits) unless a stage installs a head
    # that computes it inside the forward (the chunked loss)
    loss_head: LossHead = dataclasses.field(default_factory=LossHead)

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


def causal_lm_of(obj, pm):
    """The Hugging Face causal LM ``obj`` is, or wraps (a plugin's ``ultrascale_declare_model_wrapper``: a PEFT model), or
    None: what the front ends hand to ``parallelize``."""
    from transformers import PreTrainedModel

    if not isinstance(obj, nn.Module):
        return None
    inner = pm.wrapper_of(obj).inner
    return inner if isinstance(inner, PreTrainedModel) and hasattr(inner, "lm_head") else None


def as_config(config: ParallelConfig | dict | None) -> ParallelConfig:
    if config is None:
        return ParallelConfig()
    return ParallelConfig.from_dict(config) if isinstance(config, dict) else config


def registry_of(config: ParallelConfig | dict | None, pm=None):
    """(registry, config made under it): ``pm`` when given, else the registry ``config`` was made under (a dict or
    None: the default one, as ``ParallelConfig(...)`` makes it)."""
    config = as_config(config) if pm is None else (pm.config(**config) if isinstance(config, dict) else
                                                    as_config(config).under(pm))
    return config.registry, config


def validate(config: ParallelConfig, model_config: Any, world_size: int, pm=None, model=None) -> ParallelConfig:
    """Every check that needs no process group: degrees vs world size, vs the model, and each plugin's own;
    with ``model`` (real or on the meta device) also the checks on its module tree and plan.
    Returns the resolved config (the ``-1`` degree filled in).

    The module-tree checks (meta-device dry runs) are skipped only in a worker that ``ultrascale train`` started
    after running them itself on the same layout, world size, model and plugins (``VALIDATED_ENV`` holds their
    ``validated_fingerprint``); a process started any other way runs them all."""
    pm, config = registry_of(config, pm)
    chosen = pm.hook.ultrascale_validate_choose_layout(config=config, model_config=model_config, world_size=world_size)
    resolved = pm.resolve(chosen if chosen is not None else config, world_size)
    pm.hook.ultrascale_validate_config(config=resolved, model_config=model_config, world_size=world_size, loop=None)
    order_stages(pm.stages(resolved, model_config))  # a cycle or an unknown stage name, before any group
    if model is not None and not _validated_by_launcher(resolved, world_size, model, pm):
        plan = model_plan(model, resolved, pm)
        pm.hook.ultrascale_validate_model(model=model, plan=plan, config=resolved)
    return resolved


def validate_loop(config: ParallelConfig, micro_batches: int, max_grad_norm: float | None, pm=None) -> None:
    """The checks of the training loop a front end will run with this layout: ``micro_batches`` per optimizer
    step, gradients clipped to ``max_grad_norm`` (None or 0: not clipped). Every plugin's
    ``ultrascale_validate_config`` is asked with the loop (no model config; the world the config's degrees make, a
    ``-1`` counted as 1), so its checks of the layout alone run again: a config that resolved passes them (its
    ``auto`` fields filled in first, as resolving does: a front end may hold the layout as written)."""
    pm, config = registry_of(config, pm)
    config = pm.fill_auto(config)
    world_size = math.prod(max(a.degree, 1) for a in pm.axes(config))
    pm.hook.ultrascale_validate_config(config=config, model_config=None, world_size=world_size,
                                       loop=TrainingLoop(int(micro_batches), max_grad_norm or None))


VALIDATED_ENV = "ULTRASCALE_VALIDATED"


def validated_fingerprint(resolved: ParallelConfig, world_size: int, model, pm=None) -> str:
    """A digest of everything the module-tree checks of ``validate`` depend on: the resolved layout, the world
    size, the model's class and full config, the registered plugins and their versions, and the versions of this
    package, torch and transformers. ``ultrascale train`` hands it to the workers it starts (``VALIDATED_ENV``)
    after the same checks passed before launch, so each worker does not repeat them."""
    import hashlib
    import json

    import transformers

    from importlib.metadata import version  # the package's own, as installed (its __init__ is above the engine)

    pm = pm or resolved.registry
    dists = {id(plugin): f"{dist.project_name}=={dist.version}" for plugin, dist in pm.list_plugin_distinfo()}
    plugins = sorted(f"{name}:{dists.get(id(plugin), 'builtin')}" for name, plugin in pm.list_name_plugin()
                     if plugin is not None)
    cls = type(model)
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}  # where it was read from
    what = {"layout": resolved.to_dict(), "world_size": world_size, "model": f"{cls.__module__}.{cls.__qualname__}",
            "config": config, "plugins": plugins,
            "versions": [version("ultrascale-plugins"), torch.__version__, transformers.__version__]}
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
    pm, config = registry_of(config, pm)
    resolved = validate(config, model_config, world_size, pm)
    return order_stages(pm.stages(resolved, model_config))


def describe_parts(config: ParallelConfig | dict, model_config: Any, *, world_size: int | None = None,
                   pm=None) -> dict[str, str]:
    """What ``describe`` prints, part by part: ``mesh`` (the axes in order and the views, each with its after /
    before), ``transforms`` (the active stages in order), ``step hooks`` (the plugins that answer each step hook,
    in call order) and ``cost chain`` (``ultrascale_cost_estimate``'s steps in order)."""
    from ..interface.hookspecs import GROUPS
    from ..interface.stages import placement
    from .chains import describe_cost_chain, describe_step_hooks

    pm, config = registry_of(config, pm)
    if world_size is None:
        world_size = math.prod(max(a.degree, 1) for a in ParallelDims(config).axes)
    resolved = validate(config, model_config, world_size, pm)
    dims = ParallelDims(resolved, world_size)
    mesh = [dims.describe()]
    for axis in dims.axes:
        where = placement(axis)
        mesh.append(f"axis {axis.name}={axis.degree}" + (f"  [{where}]" if where else ""))
    for name, view in dims.views.items():
        over = " x ".join(f"{a.name}={a.degree}" for a in view.axes)
        mesh.append(f"view {name}: {over} over the ranks of {'*'.join(view.source)}")
    return {"mesh": "\n".join(mesh),
            "transforms": describe_stages(order_stages(pm.stages(resolved, model_config))),
            "step hooks": describe_step_hooks(pm, GROUPS, resolved, model_config),
            "cost chain": describe_cost_chain(pm, resolved, model_config)}


def describe(config: ParallelConfig | dict, model_config: Any, *, world_size: int | None = None, model=None,
             pm=None) -> str:
    """The layout as ``parallelize`` runs it, part by part (``describe_parts``; a title line, then the part):
    the mesh and its views, the model transforms in order (name, mesh axes, what it does to the model, the plugin,
    its after / before), the plugins answering each step hook in call order, and the cost chain in order.
    ``world_size``: default, the product of the layout's degrees. ``model``: the model to be parallelized, when it
    wraps the causal LM (a PEFT model): a first line says what its wrapper (``ultrascale_declare_model_wrapper``) is and
    how its modules go through the stages."""
    pm, config = registry_of(config, pm)
    parts = describe_parts(config, model_config, world_size=world_size, pm=pm)
    text = "\n\n".join(f"{title}:\n{body}" for title, body in parts.items())
    wrapper = pm.wrapper_of(model) if model is not None else None
    if wrapper is not None and wrapper.wraps:
        text = f" 0. the model: {wrapper.describe()}  ({type(wrapper).__module__})\n" + text
    return text


def estimate(config: ParallelConfig, model_config: Any, *, world_size: int, seq_len: int = 2048,
             micro_batch: int = 1, micro_batches: int = 1, coords: dict | None = None, model=None,
             profile: str = "ultrascale", optimizer: str = "adamw", check: bool = True, pm=None, plan=None,
             **constants):
    """Per-rank memory by category, communication terms per mesh axis and compute factors (an
    ``estimates.Estimate``), each contributed by its dimension's plugin through ``ultrascale_cost_estimate``.

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
    pm, config = registry_of(config, pm)
    resolved = validate(config, model_config, world_size, pm) if check else pm.resolve(config, world_size, check=False)
    return resolved_cost(resolved, model_config, pm=pm, seq_len=seq_len, micro_batch=micro_batch,
                         micro_batches=micro_batches, coords=coords, model=model, profile=profile,
                         optimizer=optimizer, plan=plan, **constants)


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


def place(model: nn.Module, config: ParallelConfig, *, device=None, init_weights=None, pm=None) -> ParallelModel:
    """Place ``model`` (a Hugging Face causal LM) over the current process group in the layout ``config`` (resolved
    and checked: ``validate``): the process group and the mesh, the model plan, the stages in their resolved order;
    then ``init_weights.load(ctx, buffers)`` gives a meta-device model's shards storage and values (the engine
    reads no file: the loader is the caller's, ``checkpoints.load.parallelize``). Without a loader the model keeps
    the values it holds."""
    pm, config = registry_of(config, pm)
    if device is None:
        device = launch.init_distributed()
    elif not dist.is_initialized():
        launch.init_distributed()
    dims = ParallelDims(config, launch.world_size())
    dims.build_mesh(device.type, launch.collective_timeout())
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
    for stage in order_stages(pm.stages(config, model.config)):
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
    modules stays shared; a dry run's fake tensors hold no memory and are left as they are."""
    from torch.distributed.tensor import DTensor

    from ..interface.fake_values import is_fake

    held = set()
    for part in parts:
        for tensor in part.parameters():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if not local.is_meta and local.numel() and not is_fake(local):  # a dry run's: no storage to find
                held.add(local.untyped_storage().data_ptr())
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.is_meta or isinstance(param, DTensor) or not param.numel() or is_fake(param):
                continue
            if id(param) not in replaced:
                if param.untyped_storage().data_ptr() in held:
                    continue
                replaced[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
            module._parameters[name] = replaced[id(param)]


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

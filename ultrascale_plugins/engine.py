"""The engine: ``parallelize(model, config)`` validates, builds the mesh, asks every plugin to transform the
model phase by phase, and returns a ``ParallelModel`` whose ``train_step`` every front end calls."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from . import launch
from .config import ConfigError, ParallelConfig
from .hookspecs import TRANSFORM_PHASES
from .mesh import build_mesh, sub_mesh
from .models.plan import ModelPlan
from .plugins import get_plugin_manager

DIMENSION_NAMES = {"pp": "pipeline parallelism", "cp": "context parallelism", "tp": "tensor parallelism",
                   "dp_shard": "sharded data parallelism", "dp_replicate": "replicated data parallelism"}


@dataclasses.dataclass
class ParallelContext:
    """What the plugins see while transforming: the resolved config, the mesh, the plan and the device."""

    config: ParallelConfig
    mesh: Any
    plan: ModelPlan | None
    device: torch.device
    modules: list = dataclasses.field(default_factory=list)  # this rank's model parts (pipeline stages, or one)
    forward_module: nn.Module | None = None  # what train_step calls (a DDP wrapper, or the model itself)
    autocast_dtype: torch.dtype | None = None  # mixed precision outside FSDP
    extras: dict = dataclasses.field(default_factory=dict)  # free room for third-party plugins

    _materializer: Any = None

    def materialize(self) -> None:
        """Give a meta-device model's parameters storage and their values, in their layout at this point (once).
        The engine calls it after the last phase; a phase that needs real tensors (DDP broadcasts them when it
        wraps the model) calls it first."""
        if self._materializer is not None:
            load, self._materializer = self._materializer, None
            load()

    def sub_mesh(self, name: str):
        return sub_mesh(self.mesh, name)

    def plan_layers(self, model: nn.Module) -> list[str]:
        """The decoder layers present in ``model`` (a pipeline stage holds only some)."""
        names = set(getattr(model, "_no_split_modules", None) or [])
        present = {fqn for fqn, m in model.named_modules() if type(m).__name__ in names}
        if self.plan is not None and self.plan.layers:
            return [fqn for fqn in self.plan.layers if fqn in present]
        return [fqn for fqn, _ in model.named_modules() if fqn in present]


def validate(config: ParallelConfig, model_config: Any, world_size: int, pm=None, model=None) -> ParallelConfig:
    """Every check that needs no process group: degrees vs world size, vs the model, and each plugin's own;
    with ``model`` (real or on the meta device) also the checks on its module tree and plan.
    Returns the resolved config (dp_shard filled in)."""
    pm = pm or get_plugin_manager()
    resolved = config.resolve(world_size)
    axes = declared_axes(resolved, pm)
    for field in ("pp", "cp", "tp", "dp_shard", "dp_replicate"):
        degree = getattr(resolved, field)
        if degree > 1 and field not in axes:
            raise ConfigError(
                f"{field}={degree}: {DIMENSION_NAMES[field]} is not available in this version (no installed plugin "
                f"provides the '{field}' axis). Fix: set {field}: 1, or install a plugin that provides it")
    resolved.validate_for_model(model_config)
    pm.hook.ultrascale_validate_config(config=resolved, model_config=model_config, world_size=world_size)
    if model is not None:
        plan = pm.hook.ultrascale_model_plan(model=model, config=resolved)
        pm.hook.ultrascale_validate_model(model=model, plan=plan, config=resolved)
    return resolved


def declared_axes(config: ParallelConfig, pm) -> dict[str, int]:
    axes: dict[str, int] = {}
    for result in pm.hook.ultrascale_mesh_axes(config=config):
        for name, degree in result or []:
            axes[name] = degree
    return axes


def estimate(config: ParallelConfig, model_config: Any, *, world_size: int, seq_len: int = 2048,
             micro_batch: int = 1) -> dict[str, float]:
    """Per-rank memory (bytes) and communication (bytes per step) terms, each contributed by its dimension's
    plugin through ``ultrascale_estimate``. Validates the layout first."""
    pm = get_plugin_manager()
    resolved = validate(config, model_config, world_size, pm)
    est: dict[str, float] = {"seq_len": seq_len, "micro_batch": micro_batch}
    pm.hook.ultrascale_estimate(config=resolved, model_config=model_config, estimate=est)
    return est


def parallelize(model: nn.Module, config: ParallelConfig | dict | None = None, *, device=None,
                init_weights=None) -> "ParallelModel":
    """Shard ``model`` (a Hugging Face causal LM) over the current process group according to ``config``.

    ``model`` may live on the meta device (``pretrained.empty_model``); then ``init_weights`` (an object with
    ``load(ctx, buffers)``, e.g. ``pretrained.PretrainedWeights``) gives every rank's shards storage and values
    once the layout is final, so no rank ever holds the whole model."""
    if config is None:
        config = ParallelConfig()
    elif isinstance(config, dict):
        config = ParallelConfig.from_dict(config)
    pm = get_plugin_manager()
    world = launch.world_size()
    resolved = validate(config, model.config, world, pm, model=model)  # before any process group exists
    if device is None:
        device = launch.init_distributed()
    elif not dist.is_initialized():
        launch.init_distributed()
    plan = pm.hook.ultrascale_model_plan(model=model, config=resolved)
    mesh = build_mesh(device.type, declared_axes(resolved, pm))
    ctx = ParallelContext(config=resolved, mesh=mesh, plan=plan, device=device, modules=[model])
    if init_weights is None and any(p.is_meta for p in model.parameters()):
        raise ConfigError("the model's parameters are on the meta device and no weights were given. Fix: use "
                          "ultrascale_plugins.pretrained.from_pretrained(HF_DIR, config), or build the model "
                          "with real tensors")
    if init_weights is not None:  # the weights replace whatever the parameters hold now
        buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if not buf.is_meta}
        ctx._materializer = lambda: init_weights.load(ctx, buffers)
    else:
        model.to(device)
    for phase in TRANSFORM_PHASES:
        # the pipeline phase may replace ctx.modules by this rank's stages; later phases transform each
        for module in list(ctx.modules):
            pm.hook.ultrascale_transform_model(model=module, ctx=ctx, phase=phase)
    ctx.materialize()
    return ParallelModel(ctx.modules[0], ctx, pm)


class ParallelModel:
    """A parallelized model and its training step. ``module`` is the Hugging Face model (sharded in place)."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, pm):
        self.module = module
        self.ctx = ctx
        self.config = ctx.config
        self.pm = pm
        self.forward_module = ctx.forward_module or module
        dp = ctx.sub_mesh("dp")
        self._dp_group = dp.get_group() if dp is not None else None
        self.data_parallel_size = dp.size() if dp is not None else 1
        self.data_parallel_rank = dp.get_local_rank() if dp is not None else 0
        self.device = ctx.device
        self.grad_sync = True  # False inside no_sync()

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
        pipe = self.ctx.extras.get("pipeline")
        return pipe.last_step_stats if pipe is not None else None

    def build_optimizer(self, optimizer_cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
        """The optimizer for this layout: ZeRO-1 shards its states over data parallel; otherwise plain."""
        opt = self.pm.hook.ultrascale_build_optimizer(pmodel=self, optimizer_cls=optimizer_cls, kwargs=kwargs)
        return opt if opt is not None else optimizer_cls(self.parameters(), **kwargs)

    def train_step(self, batch: dict, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward on this rank's share of the global batch; returns the global-mean loss.
        Gradients are those of ``loss_scale`` x that loss, added to any already there."""
        self.module.train()
        return self.pm.hook.ultrascale_train_step(pmodel=self, batch=batch, loss_scale=loss_scale)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no data-parallel reduction, no tied-weight sums); the first backward
        after the block synchronises everything accumulated. For gradient accumulation."""
        from torch.distributed.fsdp import FSDPModule

        fsdp = [m for m in self.modules if isinstance(m, FSDPModule)]
        ddp = self.forward_module if hasattr(self.forward_module, "no_sync") else None
        self.grad_sync = False
        for m in fsdp:
            m.set_requires_gradient_sync(False)
        try:
            with (ddp.no_sync() if ddp is not None else contextlib.nullcontext()):
                yield
        finally:
            self.grad_sync = True
            for m in fsdp:
                m.set_requires_gradient_sync(True)

    @torch.no_grad()
    def eval_step(self, batch: dict) -> torch.Tensor:
        """Validation loss of the global batch (``model.eval()`` semantics: no dropout)."""
        pipe = self.ctx.extras.get("pipeline")
        if pipe is not None:
            return pipe.step(self, batch, train=False)
        self.module.eval()
        try:
            loss_sum, count = self.loss_terms(batch)
            return self.reduce_loss(loss_sum, count)
        finally:
            self.module.train()

    def __call__(self, *args, **kwargs):
        return self.forward_module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of all gradients of the unsharded model (DTensor/sharded gradients included)."""
        from .grad_norm import clip_grad_norm_

        pipe = self.ctx.extras.get("pipeline")
        params, group = list(self.parameters()), None
        if pipe is not None:
            group = pipe.pp_group
            if pipe.has_last and pipe.tied:
                head = pipe.tied_params()[-1]  # the head's copy of the tied weight: count it once
                params = [p for p in params if p is not head]
        return clip_grad_norm_(params, max_norm, norm_type, group=group, clip=list(self.parameters()))

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the training state: ``{"model": ...}`` (DTensors where sharded, the unparallelized
        model's parameter names) plus whatever each dimension adds through ``ultrascale_state_dict``."""
        model_state: dict[str, Any] = {}
        for module in self.modules:
            model_state.update(module.state_dict())
        state: dict[str, Any] = {"model": model_state, "config": self.config.to_dict()}
        self.pm.hook.ultrascale_state_dict(pmodel=self, state=state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by ``state_dict`` in the same layout."""
        saved = state.get("config")
        if saved is not None and saved != self.config.to_dict():
            diff = {k: (v, self.config.to_dict()[k]) for k, v in saved.items() if self.config.to_dict().get(k) != v}
            raise ConfigError(f"state was saved in another layout (saved vs current: {diff}). Fix: load it in the "
                              "layout it was saved in")
        for module in self.modules:
            own = module.state_dict().keys()
            module.load_state_dict({k: v for k, v in state["model"].items() if k in own})
        self.pm.hook.ultrascale_load_state_dict(pmodel=self, state=state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, gathered to full CPU tensors on every rank (for checks and export)."""
        out = {}
        for module in self.modules:
            for name, tensor in module.state_dict().items():
                if isinstance(tensor, DTensor):
                    tensor = tensor.full_tensor()
                out[name] = tensor.detach().cpu().clone()
        pipe = self.ctx.extras.get("pipeline")
        if pipe is not None:  # every stage's part, on every rank
            parts = [None] * dist.get_world_size(pipe.pp_group)
            dist.all_gather_object(parts, out, group=pipe.pp_group)
            out = {k: v for part in parts for k, v in part.items()}
        return out

    # ---- pieces of the step, used by step plugins ------------------------------------------------
    def to_device(self, batch: dict) -> dict:
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def global_token_count(self, targets: torch.Tensor) -> torch.Tensor:
        from .loss import IGNORE_INDEX

        count = (targets != IGNORE_INDEX).sum().to(torch.float64)
        if self._dp_group is not None:
            dist.all_reduce(count, group=self._dp_group)
        return count.clamp_min(1)

    def autocast(self):
        dtype = self.ctx.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def loss_context(self):
        if self.config.loss_parallel and self.config.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def loss_terms(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of this rank's token losses, global number of valid tokens)."""
        _, loss_sum, count = self.forward_loss(batch)
        return loss_sum, count

    def forward_loss(self, batch: dict) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """(the model's output, sum of this rank's token losses, global number of valid tokens)."""
        from .loss import shifted_targets, token_loss_sum

        batch = self.to_device(batch)
        targets = shifted_targets(batch)
        count = self.global_token_count(targets)
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if batch.get(k) is not None}
        with self.autocast():
            output = self.forward_module(**inputs, use_cache=False)
        with self.loss_context():
            loss_sum = token_loss_sum(output.logits, targets)
        if getattr(output, "router_logits", None):  # mixture of experts with output_router_logits on
            from .router_loss import router_aux_loss

            aux = router_aux_loss(self.module, output.router_logits, batch.get("attention_mask"), self._dp_group)
            # folded into the token-loss sum, which the step scales by dp/count: the gradient part (aux*count)
            # gives coef*aux's gradient after the data-parallel average; the value part (aux*count/dp) sums to
            # coef*aux over the data-parallel ranks
            grad_part = aux * count.to(aux.dtype)
            term = grad_part + (grad_part / self.data_parallel_size - grad_part).detach()
            if isinstance(loss_sum, DTensor):
                term = DTensor.from_local(term, loss_sum.device_mesh, loss_sum.placements, run_check=False)
            loss_sum = loss_sum + term
        return output, loss_sum, count

    def reduce_loss(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        total = loss_sum.detach()
        if isinstance(total, DTensor):
            total = total.full_tensor()
        total = total.to(torch.float64)
        if self._dp_group is not None:
            dist.all_reduce(total, group=self._dp_group)
        return (total / count).float()

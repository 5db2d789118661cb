"""``ParallelModel``: a parallelized model and its training step, what ``engine.parallelize`` returns and every
front end drives (the CLI through ``train_step``, Lightning and Accelerate through ``hf_module.ParallelCausalLM``).
It holds the step and its hooks (forward, backward, ``train_step`` / ``eval_step``, ``no_sync``, the optimizer,
clipping, the training state); the other jobs are objects it reaches: ``tokens`` (token accounting,
``core.tokens``), ``outputs`` (what a trainer computing its own loss reads, ``core.outputs``), ``gradients`` (the
averaging the engine does itself, ``core.gradients``), and ``profile_step`` records a step's communication
(``core.comm_report``)."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable

import torch
from torch import nn

from ..distributed.grad_norm import clip_grad_norm_
from ..distributed.loss import shifted_targets
from ..interface.config import ConfigError
from .batches import to_device
from .chains import ordered_chain
from .comm_report import record_step
from .gradients import GradientReductions
from .outputs import TrainerOutputs
from .plugin_state import PluginState
from .tokens import TokenAccounting


class ParallelModel:
    """A parallelized model and its training step. ``module`` is the Hugging Face model (sharded in place)."""

    def __init__(self, module: nn.Module, ctx, pm):
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
        self.tokens = TokenAccounting(self.dims, self.device, pm)
        self.outputs = TrainerOutputs(self)
        self.gradients = GradientReductions(ctx, list(self.parameters()))
        self.grad_sync = True  # False inside no_sync()
        # the ultrascale_step_shard_batch implementations in the order of this layout's stages, ordered once (the layout
        # and the plugins do not change after parallelize)
        self.batch_split = ordered_chain(pm, "ultrascale_step_shard_batch", ctx.config)
        self.recording = None  # the step being recorded (profile_step), which notes the batches
        # each plugin's part in the loss (ultrascale_step_loss: its context, its terms), asked once: the layout and
        # the plugins do not change after parallelize
        self.loss_parts = [part for part in pm.hook.ultrascale_step_loss(pmodel=self) if part is not None]

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
        replaced = self.pm.hook.ultrascale_step_optimizer(pmodel=self, optimizer=optimizer)
        return replaced if replaced is not None else optimizer

    def build_optimizer(self, optimizer_cls=torch.optim.AdamW, **kwargs) -> torch.optim.Optimizer:
        return self.prepare_optimizer(optimizer_cls(list(self.parameters()), **kwargs))

    def train_step(self, batch: dict, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward on this rank's share of the global batch; returns the global-mean loss.
        Gradients are those of ``loss_scale`` x that loss, added to any already there."""
        for module in self.modules:
            module.train()
        return self.pm.hook.ultrascale_step_run(pmodel=self, batch=batch, loss_scale=loss_scale)

    @torch.no_grad()
    def eval_step(self, batch: dict) -> torch.Tensor:
        """Validation loss of the global batch (``model.eval()`` semantics: no dropout)."""
        return self.runtime.eval_step(self, batch)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no data-parallel reduction, no tied-weight sums); the first backward
        after the block synchronises everything accumulated. For gradient accumulation. Each dimension's
        wrappers stop reducing through ``ultrascale_step_no_sync``."""
        self.grad_sync = False
        try:
            with contextlib.ExitStack() as stack:
                for context in self.pm.hook.ultrascale_step_no_sync(pmodel=self):
                    if context is not None:
                        stack.enter_context(context)
                yield
        finally:
            self.grad_sync = True

    def __call__(self, *args, **kwargs):
        return self.forward_module(*args, **kwargs)

    def profile_step(self, out=print):
        """Record every collective this rank issues inside the block, meant to hold one optimizer step as the
        loop runs it (its ``train_step`` calls, ``no_sync``, ``clip_grad_norm_``, ``optimizer.step()``), then
        gather every rank's record and set it out per mesh axis and operation beside the package's estimate for
        the same step and the layout's minimum. Every rank must run the block. Yields a
        ``comm_report.StepProfile``, whose ``table`` (text) and ``rows`` are filled when the block ends; rank 0
        hands the table to ``out`` (None: nothing printed). Nothing it records changes what runs."""
        return record_step(self, out)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of all gradients of the unsharded model (DTensor/sharded gradients included)."""
        if self.gradients.consumed:
            if math.isinf(max_norm):  # only the norm, to log it (the Trainer asks every step): there is none
                return torch.tensor(float("nan"))
            raise ConfigError(f"gradient clipping: {self.gradients.consumed}, so there is no global norm to clip "
                              "to. Fix: turn clipping off (max_grad_norm: 0)")
        params = list(self.parameters())
        return clip_grad_norm_(self.runtime.norm_parameters(params), max_norm, norm_type,
                               group=self.runtime.norm_group(), clip=params)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the training state: ``{"model": ...}`` (DTensors where sharded, the unparallelized
        model's parameter names), the layout, and what each dimension adds through ``ultrascale_state_save``."""
        model_state: dict[str, Any] = {}
        for module in self.modules:
            model_state.update(module.state_dict())
        plugins = PluginState()
        self.pm.hook.ultrascale_state_save(pmodel=self, state=plugins)
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
            self.pm.hook.ultrascale_state_load(pmodel=self, state=state["plugins"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, gathered to full CPU tensors on every rank (for checks and export)."""
        out, wrapper = {}, self.pm.wrapper_of(self.module)  # a wrapper's tensor subclasses gather its own way
        for module in self.modules:
            for name, tensor in module.state_dict().items():
                out[name] = wrapper.whole_value(tensor).detach().cpu().clone()
        return self.runtime.gather_full_state(out)

    # ---- the step's pieces: the built-in step, the pipeline runtime and the front ends use these --------
    def prepare_batch(self, batch: dict) -> dict:
        """This rank's inputs and next-token ``targets`` on the device: the data loader's rows, then each
        dimension's part of them (``ultrascale_step_shard_batch``). Targets are shifted before any plugin splits the
        sequence, so the token after a split point stays the target of the one before it."""
        batch = to_device(batch, self.device)
        if self.recording is not None:
            self.recording.saw_batch(batch)
        out = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if batch.get(k) is not None}
        out["targets"] = shifted_targets(batch)
        for step in self.batch_split:  # each dimension's part, in the order of the stages' names
            step.run(batch=out, ctx=self.ctx)
        return {k: v.contiguous() for k, v in out.items()}  # a strided split would reach collectives as a view

    def autocast(self):
        """Mixed precision outside FSDP (``ParallelContext.autocast_dtype``), or nothing."""
        dtype = self.ctx.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    @contextlib.contextmanager
    def loss_context(self):
        """Where the loss and its backward run: every ``loss_parts``' context entered (``ultrascale_step_loss``)."""
        with contextlib.ExitStack() as stack:
            for part in self.loss_parts:
                stack.enter_context(part.context())
            yield

    def forward(self, batch: dict):
        """The model's output on this rank's batch, with ``loss``: its value is the global-mean loss over every
        valid token of the global batch (the same on every rank), its gradient this rank's share of it. Under
        ``torch.no_grad`` the loss is the plain global mean."""
        batch = self.prepare_batch(batch)
        targets = batch.pop("targets")
        count = self.tokens.global_count(targets)
        with self.autocast(), self.outputs.forward_targets(targets):
            output = self.forward_module(**batch, use_cache=False)
        with self.loss_context():
            loss_sum = self.outputs.token_loss_sum(output.logits, targets)
        if output.logits is loss_sum:  # the forward computed the loss (the chunked loss): there are no logits
            output.logits = None
        loss_sum = self.tokens.add_terms(loss_sum, self.outputs.loss_terms(output, batch), count)
        output.loss = self.tokens.mean(loss_sum, count)
        return output

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
        self.gradients.average()
        self.runtime.after_backward(self)
        self.pm.hook.ultrascale_step_after_backward(pmodel=self)

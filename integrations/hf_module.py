"""The parallelized model behind Hugging Face's call signature, for front ends whose user code does
``loss = model(**batch).loss`` and then ``backward`` (Lightning's ``training_step``, an Accelerate loop).

``loss`` is the global-mean loss over every valid token of the global batch, on every rank, as one process
would compute it. Its gradient is this rank's share (token-loss sum x dp / global tokens), so after the
data-parallel average the gradients are exactly the single-process ones even when ranks hold different numbers
of padded tokens.

With a pipeline the schedule runs forward *and* backward together: in training mode the call runs the whole
step (``ParallelModel.train_step``) and returns the loss without a graph; the front end's backward becomes
``apply_pending_grads``. In eval mode it runs the forward-only pass. Logits are not gathered through a pipeline.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from ..interface.config import ConfigError
from ..core.batches import to_device


_SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def size_in_bytes(size: int | str) -> int:
    """``save_pretrained``'s ``max_shard_size`` in bytes, with Hugging Face's spellings: an int, or a number with
    a unit, ``"5GB"`` (10**9), ``"5GiB"`` (2**30), ``"200KB"``, ``"1.5MiB"``...; a lower-case final ``b``
    (``"5Gb"``) means bits."""
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    text = str(size).strip()
    for unit, factor in _SIZE_UNITS.items():
        if text.upper().endswith(unit):
            try:
                value = int(float(text[:-len(unit)]) * factor)
            except ValueError:
                break
            if value >= 0:
                return value // 8 if text.endswith("b") and not unit.endswith("IB") else value
            break
    raise ConfigError(f"max_shard_size={size!r}: not a size. Fix: an int (bytes) or a number with a unit, "
                      "e.g. '5GB' or '500MiB'")


class _PipelinedLoss(torch.autograd.Function):
    """The loss of a pipelined call: its backward already ran inside the schedule. A plain ``loss.backward()``
    would silently do nothing, so it fails and names the call that applies the gradients."""

    @staticmethod
    def forward(ctx, anchor, value):
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        raise ConfigError("pp>1: the pipeline schedule already ran forward and backward inside model(**batch); "
                          "loss.backward() has nothing to do. Fix: call accelerator.backward(loss) (Accelerate) "
                          "or return the loss from training_step (Lightning), which apply the gradients")


class ParallelCausalLM(nn.Module):
    def __init__(self, pmodel):
        super().__init__()
        self.pmodel = pmodel
        self.parts = nn.ModuleList(pmodel.modules)  # this rank's (sharded) parameters, for optimizers
        self.config = pmodel.module.config
        self.loss_scale = 1.0  # the pipeline's backward runs inside the call: the front end's 1/k goes here
        self.pending_grads: list | None = None  # gradients of the last pipelined call, until apply_pending_grads

    def train(self, mode: bool = True):
        """``nn.Module.train``, and the Hugging Face module's flag with it: a pipeline's stages are copies of its
        parts, and front ends read ``model.training`` from the module they were given (TRL picks its metrics by it)."""
        super().train(mode)
        self.pmodel.module.train(mode)
        return self

    @property
    def pipelined(self) -> bool:
        return self.pmodel.runtime.backward_in_forward

    def _pipeline_step(self, batch):
        """Forward and backward through the schedule, into fresh gradients that are set aside until the front
        end's backward (``apply_pending_grads``): a front end may zero the gradients between its forward and
        its backward (Lightning does), and the new ones must survive that while older ones must not leak in."""
        params = [p for p in self.parameters()]
        old = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self.pmodel.train_step(batch, loss_scale=self.loss_scale)
        self.pending_grads = [(p, p.grad) for p in params]
        for p, g in zip(params, old):
            p.grad = g
        return _PipelinedLoss.apply(torch.zeros((), requires_grad=True), loss)

    def apply_pending_grads(self) -> bool:
        """Add the last pipelined call's gradients, as a backward would. False when there are none (no
        pipeline, or not called in training mode)."""
        if self.pending_grads is None:
            return False
        for p, g in self.pending_grads:
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self.pending_grads = None
        return True

    def forward(self, input_ids=None, attention_mask=None, labels=None, position_ids=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if torch.is_inference_mode_enabled():
            # FSDP keeps some parameters gathered between forwards; gathered inside inference mode they would be
            # inference tensors that a later training step silently reuses (Lightning validates under
            # inference_mode). Evaluate under no_grad instead.
            with torch.inference_mode(False), torch.no_grad():
                return self.forward(input_ids, attention_mask, labels, position_ids, **kwargs)
        batch = {k: v for k, v in (("input_ids", input_ids), ("attention_mask", attention_mask),
                                   ("labels", labels), ("position_ids", position_ids)) if v is not None}
        pm = self.pmodel
        whole_rows = kwargs.pop("whole_rows", False)
        if kwargs.pop("fused_lm_head", False):
            # TRL's fused LM head: each token's log-probability, entropy and top-1 hit, never the whole logits
            # (pmodel.outputs.token_outputs; the chunked loss computes them a chunk of tokens at a time);
            # whole_rows: each row's tokens whole on every rank holding some of them (a preference loss)
            if labels is None:
                raise ConfigError("fused_lm_head=True needs labels: the log-probabilities are of the next tokens")
            # the batch's other keys (a collator's seq_idx, ...) are not the model's: only what it should return
            flags = {k: kwargs[k] for k in ("output_router_logits",) if k in kwargs}
            return pm.outputs.token_outputs(batch, whole_rows=whole_rows, **flags)
        if self.pipelined:
            if labels is None:
                raise ConfigError("pp>1: a pipelined model returns the loss, not logits (they stay on the last "
                                  "stage). Fix: call model(**batch, labels=...) and use .loss")
            if self.training and torch.is_grad_enabled():
                loss = self._pipeline_step(batch)
            else:
                loss = pm.eval_step(batch)
            return CausalLMOutputWithPast(loss=loss)
        if labels is None:
            with pm.autocast():
                return pm.forward_module(**to_device(batch, pm.device), **kwargs)
        # the engine's forward, as in the CLI's step: the loss's value is the global mean, its gradient this rank's
        # share, so a front end's backward of it (plus any term the user adds) gives exact gradients
        return pm.forward(batch)

    def no_sync(self):
        """Accumulate gradients without data-parallel reduction. A pipeline reduces each call's own gradients
        instead (its backward runs inside the call; the reductions are linear, so the sum of reduced parts is the
        reduced sum)."""
        return self.pmodel.no_sync() if not self.pipelined else contextlib.nullcontext()

    def save_pretrained(self, save_directory, max_shard_size: int | str = "5GB", **ignored) -> None:
        """Write a Hugging Face directory (safetensors, config, generation config) of the whole model, or what a
        plugin writes for its kind of model (a PEFT model: its adapters, ``ModelWrapper.save_pretrained``). Every
        rank must call it: each writes its shards to a temporary sharded checkpoint, which rank 0 then streams
        into safetensors tensor by tensor (memory bounded by one output shard)."""
        if self.pmodel.pm.wrapper_of(self.pmodel.module).save_pretrained(self.pmodel, str(save_directory)):
            return
        import shutil
        from pathlib import Path

        import torch.distributed as dist

        from ..checkpoints.sharded import write_checkpoint
        from ..checkpoints.export import export_hf

        from ..distributed.launch import broadcast_object

        target = Path(save_directory)
        staging = Path(broadcast_object(str(target.parent / f".ultrascale-save-{target.name}")))
        try:
            write_checkpoint(self.pmodel, None, staging / "ckpt", step=0)
            if dist.get_rank() == 0:
                export_hf(staging / "ckpt", staging / "hf", max_shard_bytes=size_in_bytes(max_shard_size),
                          verify=False)
                target.mkdir(parents=True, exist_ok=True)
                for old in target.glob("model*.safetensors*"):
                    old.unlink()
                for f in (staging / "hf").iterdir():
                    os.replace(f, target / f.name)
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(staging, ignore_errors=True)

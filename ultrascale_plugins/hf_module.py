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

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .config import ConfigError


class ParallelCausalLM(nn.Module):
    def __init__(self, pmodel):
        super().__init__()
        self.pmodel = pmodel
        self.parts = nn.ModuleList(pmodel.modules)  # this rank's (sharded) parameters, for optimizers
        self.config = pmodel.module.config
        self.loss_scale = 1.0  # the pipeline's backward runs inside the call: the front end's 1/k goes here
        self.pending_grads: list | None = None  # gradients of the last pipelined call, until apply_pending_grads

    @property
    def pipelined(self) -> bool:
        return self.pmodel.ctx.extras.get("pipeline") is not None

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
        return loss

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
                return pm.forward_module(**pm.to_device(batch), **kwargs)
        output, loss_sum, count = pm.forward_loss(batch)
        mean = pm.reduce_loss(loss_sum, count)  # the global mean, same value on every rank
        if torch.is_grad_enabled():
            share = loss_sum * (pm.data_parallel_size / count)
            if isinstance(share, DTensor):  # vocab-parallel loss: a replicated scalar
                share = share.to_local()
            loss = (share + (mean - share).detach()).float()  # value: the global mean; gradient: this rank's
        else:
            loss = mean
        output.loss = loss
        return output

"""How this rank's model parts run a step: the typed object behind ``ParallelModel``'s step, validation pass,
gradient-norm and full-state gathering.

``Runtime`` runs one module (the whole, sharded model): forward, backward, done. A dimension that changes how a
step runs returns its own subclass from its splitting stage (``interface.stages``) — the pipeline's (``dims.pipeline.runtime``)
runs a schedule over its stages, with forward and backward inside one call.
"""
from __future__ import annotations

import torch
from torch import nn


class Runtime:
    """The model whole on this rank (possibly sharded by TP / FSDP)."""

    #: True when the forward call also runs the backward (a pipeline schedule); front ends then hand the
    #: gradients over in their backward instead of differentiating the returned loss.
    backward_in_forward = False

    def train_step(self, pmodel, batch: dict, loss_scale: float) -> torch.Tensor:
        loss = pmodel.forward(batch).loss  # the output's logits are dropped before the backward, not held through it
        pmodel.backward(loss * loss_scale)
        return loss.detach()

    @torch.no_grad()
    def eval_step(self, pmodel, batch: dict) -> torch.Tensor:
        pmodel.module.eval()
        try:
            return pmodel.forward(batch).loss
        finally:
            pmodel.module.train()

    def norm_parameters(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters whose gradients make up the global norm (each counted once)."""
        return params

    def norm_group(self):
        """The process group over which the gradient norm's partial sums are added (besides DTensor axes)."""
        return None

    def after_backward(self, pmodel) -> None:
        """Work after gradients are complete and averaged (a pipeline sums its tied embedding/head here)."""

    def gather_full_state(self, state: dict) -> dict:
        """Every rank's part of the full state (a pipeline's stages), given this rank's."""
        return state

    def from_last_stage(self, values):
        """``values`` (a small tensor or object computed where the loss is: a pipeline's last stage) on every
        rank."""
        return values

    @property
    def stats(self) -> dict | None:
        return None

"""Token accounting: how one step's loss counts the valid tokens of the global batch across ranks, reached as
``pmodel.tokens``. Every rank holds some tokens of the global batch (data parallel splits its rows, context
parallel its sequence); the loss is the mean over every valid token, so each rank's loss sum is scaled by the
global count (the loss-scale rule) and its value reduced over the ranks that hold different tokens. The built-in
step, a pipeline's schedule, gradient accumulation and a router's statistics all count through here."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed.loss import IGNORE_INDEX, valid_token_counts
from ..interface.step_schedule import StepSchedule


class TokenAccounting:
    """The token counts and loss reductions of one parallelized model (its layout ``dims``, its ``device``)."""

    def __init__(self, dims, device: torch.device, pm):
        self.dims = dims
        self.device = device
        self.pm = pm
        self.config = dims.config
        # the process group of the ranks that hold different tokens of the global batch (None: one rank)
        self.group = dims.group(dims.token_axes)

    def global_count(self, targets: torch.Tensor) -> torch.Tensor:
        """Valid target tokens over every rank that holds different tokens (the ``counts_tokens`` axes)."""
        count = (targets != IGNORE_INDEX).sum().to(torch.float64)
        if self.group is not None:
            dist.all_reduce(count, group=self.group)
        return count.clamp_min(1)

    def sum_over_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a small tensor) summed over the ranks that hold different tokens of the global batch (the
        data-parallel and context-parallel axes: the ``counts_tokens`` ones), on the CPU."""
        if self.group is None:
            return values.detach().cpu()
        out = values.detach().to(self.device)
        dist.all_reduce(out, group=self.group)
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
        ``ultrascale_cost_schedule`` hook); 1 when each call is one micro-batch."""
        return (self.pm.hook.ultrascale_cost_schedule(config=self.config) or StepSchedule()).microbatches

    def shares(self, chunks: list[dict]) -> list[float]:
        """Each micro-batch's share of the valid target tokens of a whole optimizer step on all data-parallel
        ranks (one small all-reduce over the ranks that hold different rows); one micro-batch: 1. Weighting
        each micro-batch's global-mean loss by its share (``train_step(..., loss_scale=share)``) makes the sum
        exactly the step's global token mean, in value and gradient, however unevenly padding falls."""
        if len(chunks) == 1:
            return [1.0]
        counts = self.sum_over_rows(valid_token_counts(chunks))
        total = float(counts.sum())
        return [float(c) / total if total else 1.0 / len(chunks) for c in counts]

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
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        return (total / count).float()

    def mean(self, loss_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
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

    def add_terms(self, loss_sum, terms, count: torch.Tensor):
        """``loss_sum`` (this rank's token-loss sum) with the plugins' extra terms (``ultrascale_step_loss``)
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

"""The head and the cross-entropy in chunks of tokens, forward and backward: the logits of the whole micro-batch
never exist at once.

``chunked_head_loss(hidden, weight, bias, targets, chunk, vocab)`` returns the sum of the token losses (fp32, -100
ignored) of ``hidden @ weight.T (+ bias)``; ``chunked_token_losses`` each token's (a preference loss sums them per
row; minus them, the per-token log-probabilities a trainer's own loss reads); ``chunked_token_stats`` each token's
entropy, top-1 hit and mean logit, without gradient (the metrics a trainer logs). Forward runs the head on ``chunk`` tokens at a time and keeps, per
token, only the log-sum-exp; backward runs the head again on each chunk and turns its softmax into the gradients
of the hidden states, the weight and the bias. Peak memory of the loss is one chunk's logits (fp32, and their
gradient) instead of the whole micro-batch's; the price is one more forward matmul of the head.

``vocab`` (a ``VocabShard``) says that ``weight`` holds rows ``start .. start + rows`` of a vocabulary split over
``group`` (tensor parallel): the maximum, the sum of exponentials and the target logit of each token are
all-reduced over the group (Megatron's vocabulary-parallel cross-entropy), so the loss is the whole vocabulary's on
every rank of the group, and the gradient of ``hidden`` that this function returns is this rank's part of it
(partial: the caller reduces it over the group).

Written here because torch has no chunked linear cross-entropy (Liger's fused kernel is GPU-only and knows no
vocabulary sharding). The matmuls run in the autocast dtype when the caller runs under autocast, as the head's
``nn.Linear`` would; the softmax and the accumulated weight gradient are fp32.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ...distributed.loss import IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary split over ``group``, from row ``start``."""

    group: object
    start: int


def chunked_head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                      chunk: int, vocab: VocabShard | None = None) -> torch.Tensor:
    """Sum over valid tokens of the cross-entropy of the head ``weight`` (and ``bias``) applied to ``hidden``
    ([..., hidden]) against ``targets`` ([...]), ``chunk`` tokens at a time. A 0-d fp32 tensor."""
    return chunked_token_losses(hidden, weight, bias, targets, chunk, vocab).sum()


def chunked_token_losses(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, chunk: int, vocab: VocabShard | None = None) -> torch.Tensor:
    """Each token's cross-entropy (minus its log-probability; 0 where the target is ignored), shaped like
    ``targets``, fp32: the sum is the causal-LM loss, per-row sums are the sequences' log-likelihoods a preference
    loss compares."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    return _ChunkedHeadLoss.apply(hidden, weight, bias, targets, chunk, vocab, dtype)


@torch.no_grad()
def chunked_token_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        targets: torch.Tensor, chunk: int, vocab: VocabShard | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's (entropy of the predicted distribution, whether the target is its first argmax, the mean of its
    logits over the vocabulary), shaped like ``targets``, each zero where the target is ignored: the metrics a
    trainer logs beside the loss (TRL's ``entropy``, ``is_top1`` and ``mean_logits``), ``chunk`` tokens at a time,
    without gradient. Over a vocabulary split by ``vocab``: the maximum, the sum of exponentials, the sum of
    exp(z - max)·z and the sum of the logits are all-reduced (entropy = log Σ e^z - Σ p·z), and the argmax is the
    smallest vocabulary index holding the global maximum, as ``torch.argmax`` of the whole logits picks it."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    with torch.autocast(device_type, enabled=False):
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        start, group = (vocab.start, vocab.group) if vocab is not None else (0, None)
        entropy = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
        mean = torch.zeros_like(entropy)
        top1 = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
        size = torch.tensor(float(weight.shape[0]), device=h.device)  # the whole vocabulary's rows
        if group is not None:
            dist.all_reduce(size, group=group)
        w, b = _cast(weight, bias, dtype)
        for i in range(0, h.shape[0], chunk):
            logits = _logits(h[i:i + chunk], w, b, dtype)
            top, where = logits.max(dim=-1)
            best = top.clone()
            if group is not None:
                dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
            shifted = torch.exp(logits - best.unsqueeze(1))
            sums = torch.stack([shifted.sum(-1), (shifted * logits).sum(-1), logits.sum(-1)])
            # the first index holding the maximum: this shard's candidate, or one past every index
            first = torch.where(top == best, where + start, torch.full_like(where, torch.iinfo(where.dtype).max))
            if group is not None:
                dist.all_reduce(sums, group=group)
                dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
            valid = t[i:i + chunk] != IGNORE_INDEX
            entropy[i:i + chunk] = (best + torch.log(sums[0]) - sums[1] / sums[0]) * valid
            mean[i:i + chunk] = sums[2] / size * valid
            top1[i:i + chunk] = (first == t[i:i + chunk]) & valid
            del logits, shifted
    return entropy.view(targets.shape), top1.view(targets.shape), mean.view(targets.shape)


def _cast(weight, bias, dtype):
    """The head's weight and bias in the matmul dtype, cast once per pass (not per chunk)."""
    if dtype is None:
        return weight, bias
    return weight.to(dtype), bias.to(dtype) if bias is not None else None


def _logits(h, weight, bias, dtype):
    """One chunk's logits in fp32; ``weight`` and ``bias`` already in the matmul dtype (``_cast``)."""
    if dtype is not None:
        h = h.to(dtype)
    out = h @ weight.t()
    if bias is not None:
        out = out + bias
    return out.float()


def _local_targets(t, start, rows):
    """Each target's row in this rank's shard, and whether this rank holds it (and it is not ignored)."""
    local = t - start
    held = (local >= 0) & (local < rows) & (t != IGNORE_INDEX)
    return torch.where(held, local, torch.zeros_like(local)), held


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, vocab, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.reshape(-1, hidden.shape[-1])
            t = targets.reshape(-1)
            start, group = (vocab.start, vocab.group) if vocab is not None else (0, None)
            rows = weight.shape[0]
            lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            w, b = _cast(weight, bias, dtype)
            for i in range(0, h.shape[0], chunk):
                logits = _logits(h[i:i + chunk], w, b, dtype)
                top = logits.max(dim=-1).values
                if group is not None:
                    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
                local, held = _local_targets(t[i:i + chunk], start, rows)
                picked = logits.gather(1, local.unsqueeze(1)).squeeze(1) * held
                sums = torch.stack([torch.exp(logits - top.unsqueeze(1)).sum(-1), picked])
                if group is not None:  # the sum of exponentials and the target logit: one all-reduce
                    dist.all_reduce(sums, group=group)
                lse[i:i + chunk] = top + torch.log(sums[0])
                valid = t[i:i + chunk] != IGNORE_INDEX
                losses[i:i + chunk] = (lse[i:i + chunk] - sums[1]) * valid
                del logits  # before the next chunk's exist
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.start, ctx.dtype = chunk, start, dtype
        return losses.view(targets.shape)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk, start, dtype = ctx.chunk, ctx.start, ctx.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.reshape(-1, hidden.shape[-1])
            t = targets.reshape(-1)
            grad = grad.reshape(-1)
            rows = weight.shape[0]
            grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
                if ctx.needs_input_grad[1] else None
            grad_b = torch.zeros(rows, dtype=torch.float32, device=weight.device) \
                if bias is not None and ctx.needs_input_grad[2] else None
            mm = dtype or h.dtype
            w, b = _cast(weight, bias, dtype)
            for i in range(0, h.shape[0], chunk):
                h_i = h[i:i + chunk]
                probs = torch.exp(_logits(h_i, w, b, dtype) - lse[i:i + chunk].unsqueeze(1))
                local, held = _local_targets(t[i:i + chunk], start, rows)
                probs[torch.arange(len(local), device=h.device)[held], local[held]] -= 1.0
                probs *= ((t[i:i + chunk] != IGNORE_INDEX).float() * grad[i:i + chunk]).unsqueeze(1)
                g = probs.to(mm)
                if grad_h is not None:
                    grad_h[i:i + chunk] = g @ w.to(mm)
                if grad_w is not None and mm == torch.float32:
                    grad_w.addmm_(g.t(), h_i)  # in place: no weight-sized temporary
                elif grad_w is not None:  # the low-precision product, accumulated in fp32 (no fp32 copy of it)
                    grad_w.add_(g.t() @ h_i.to(mm))
                if grad_b is not None:
                    grad_b += probs.sum(0)
                del probs, g  # before the next chunk's logits exist
        grad_h = grad_h.view_as(hidden) if grad_h is not None else None
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None

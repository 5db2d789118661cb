"""The pipeline's step on fake tensors (a dry run's: a shape and no values, over a fake process group whose
point-to-point messages carry nothing), with the real step's code.

Three things in the step need a peer's answer or a value, and get them here instead:

- **The shapes the stages exchange.** torch's stages infer what they send and receive at their first step by
  sending each other the shapes (pickled objects over P2P) and voting, with ``.item()`` on a received tensor,
  whether every stage was given its shapes. A dry run gives every stage its shapes (``static_shapes``: what the
  real run's inference finds, the hidden states crossing in the weights' dtype as the forward-only pass sends them)
  and the vote its known outcome (``skip_vote``), so nothing is exchanged.
- **Values the runtime reads** (the loss's, its scale's, a peer's vote on rebuilding): ``value`` answers a stand-in
  for a fake tensor. None of them sizes a tensor, so the bytes the step holds are the real step's.
"""
from __future__ import annotations

import torch

from ...interface.config import ConfigError
from ...interface.fake_values import is_fake


def value(tensor, stand_in):
    """``tensor``'s value as a Python number, or ``stand_in`` when it is fake (no value to read)."""
    return stand_in if is_fake(tensor) else tensor.item()


def static_shapes(stage_id: int, n_stages: int, rows: tuple, hidden: tuple, logits_width: int) -> dict:
    """``PipelineStage``'s ``input_args`` / ``output_args`` for stage ``stage_id`` of ``n_stages`` (meta tensors:
    only their shape, dtype and ``requires_grad`` are read), for micro-batches of ``rows`` (rows, sequence) token
    ids; ``hidden``: (size, dtype) of the hidden states that cross between stages; ``logits_width``: the last
    stage's logits (the vocabulary). The layout of ``split.build_stage``'s forward: the first stage takes (ids,
    mask, positions), the others (hidden states, mask, positions, ids) and hand on the same four; the last hands
    its logits to the loss (their metadata is never sent: the loss is computed where they are)."""
    size, dtype = hidden

    def meta(shape, kind, grad=False):
        return torch.empty(shape, dtype=kind, device="meta").requires_grad_(grad)

    tokens = [meta(rows, torch.long) for _ in range(3)]  # ids (mask, positions as the step makes them)
    states = (meta((*rows, size), dtype, grad=True), *tokens)
    inputs = tuple(tokens) if stage_id == 0 else states
    outputs = (meta((*rows, logits_width), dtype, grad=True),) if stage_id == n_stages - 1 else states
    return {"input_args": inputs, "output_args": outputs}


def skip_vote(schedule) -> None:
    """The schedule's warm-up vote (does every stage know its shapes?) answered without a message: every stage on
    every rank was given them (``static_shapes``), so the vote's outcome is "static". torch reads the vote with
    ``.item()`` on a tensor received from a peer, which a fake group leaves without a value. Where torch has no
    vote (releases before it), nothing to do."""
    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:  # pragma: no cover - a torch without the vote
        return
    if not hasattr(schedule, "_warmup_p2p"):  # pragma: no cover
        return

    def warmup(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup


def refuse_routed(width: int) -> None:
    """The router logits a stage hands on grow by its layers' tokens, a count the real run sends at run time: with
    the router auxiliary loss on, the dry run cannot give the stages their shapes."""
    if width:
        raise ConfigError("output_router_logits with pp > 1: the dry run does not run this yet (the router logits "
                          "each stage hands on are sized at run time). Fix: dry-run with output_router_logits off")

"""One optimizer step's accumulation window: each micro-batch's weight in the step's loss, and that data parallel
reduces the gradients only after the last one. Every front end weights its micro-batches through it.

Two weightings, because the front ends promise different losses:

- ``by_tokens`` (the command line, the Trainer): each micro-batch by its share of the window's valid tokens on all
  data-parallel ranks, so the step's loss is the mean over every valid token of the global batch, however padding
  and prompt tokens (``-100``) fall across micro-batches. The Trainer promises it too: it divides the window's
  summed token losses by ``num_items_in_batch``.
- ``even`` (Lightning, Accelerate): each of n micro-batches by 1/n, the mean of the micro-batches' means, which is
  what their users' loops compute (Lightning scales the loss by ``1 / accumulate_grad_batches``, Accelerate by
  ``1 / gradient_accumulation_steps``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable


@dataclasses.dataclass
class AccumulationWindow:
    """The weights of a window's micro-batches, in order (they sum to 1)."""

    weights: list[float]
    taken: int = 0  # the micro-batches already run (``take``)

    @classmethod
    def by_tokens(cls, pmodel, chunks: list[dict]) -> "AccumulationWindow":
        """Each micro-batch of ``chunks`` weighted by its share of the window's valid target tokens on every
        data-parallel rank (``pmodel.tokens.shares``: one small all-reduce)."""
        return cls(pmodel.tokens.shares(chunks))

    @classmethod
    def even(cls, size: int) -> "AccumulationWindow":
        """``size`` micro-batches, each weighted 1 / size."""
        return cls([1.0 / size] * size)

    def take(self) -> float | None:
        """The next micro-batch's weight, for a front end whose framework runs the micro-batches one call at a
        time; None past the window's end."""
        if self.taken >= len(self.weights):
            return None
        self.taken += 1
        return self.weights[self.taken - 1]

    def sync(self, pmodel, index: int):
        """The context micro-batch ``index`` runs in: gradients kept local (``pmodel.no_sync()``) before the last,
        reduced after it."""
        return contextlib.nullcontext() if index == len(self.weights) - 1 else pmodel.no_sync()

    def run(self, pmodel, chunks: list[dict], step: Callable[[dict, float], float]) -> float:
        """``step(chunk, weight)`` for every micro-batch, each in its ``sync`` context; the window's loss: the
        weighted sum of what ``step`` returned."""
        total = 0.0
        for i, (chunk, weight) in enumerate(zip(chunks, self.weights)):
            with self.sync(pmodel, i):
                total += weight * float(step(chunk, weight))
        return total

    def combine(self, values: list[float]) -> float:
        """The window's value of per-micro-batch values (an evaluation's losses): their weighted sum."""
        return sum(w * float(v) for w, v in zip(self.weights, values))

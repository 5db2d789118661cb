"""A plugin's part in how the step's loss is computed (``ultrascale_step_loss``): where the loss and its backward
run (``context``: tensor parallel's vocabulary-parallel cross-entropy runs inside torch's ``loss_parallel``) and
what is added to it besides the token loss (``terms``: a mixture of experts' router auxiliary loss). The engine
asks each plugin once per parallel model (``ParallelModel.loss_parts``), then, on every micro-batch, enters every
part's context around the loss and its backward and folds every part's terms into the loss: in the built-in step
and on a pipeline's last stage alike. The defaults add nothing; a part overrides what it changes."""
from __future__ import annotations

import contextlib
from typing import Any


class LossPart:
    """Nothing added: the loss runs in no context of this part's and gets no terms from it."""

    def context(self) -> contextlib.AbstractContextManager:
        """A fresh context manager the loss and its backward run inside (entered once per loss). The default:
        nothing to enter."""
        return contextlib.nullcontext()

    def terms(self, output: Any, batch: dict) -> list:
        """0-d tensors to add to the objective of one forward, besides the token loss. Each has the same value on
        every rank that holds tokens of the global batch (the token-counting axes), and on each rank the gradient
        of that rank's share, the shares' gradients summing over those ranks to the term's gradient (statistics
        gathered from every rank, the gradient kept on this rank's own); the engine folds each into the loss so
        that the step's value and gradient include it once (``tokens.add_terms``). ``output``: the model's output
        (a pipeline's last stage: one holding ``logits`` and ``router_logits``); ``batch``: this rank's prepared
        inputs (a pipeline's last stage: the ``attention_mask`` alone). The default: none."""
        return []

"""How a model's loss comes out of its forward, when a plugin computes it there instead of the engine from the whole
logits (``ParallelContext.loss_head``). The engine asks this one object, and nothing else, three things per
micro-batch: the targets a head inside the forward reads while it runs (``targets``), the token-loss sum it left
where the logits would be (``loss_sum``), and each token's figures it computed (``token_outputs``, for a trainer
computing its own loss). The default computes nothing: the engine takes the logits. A plugin whose stage moves the
loss into the forward installs its own (the chunked loss's head: ``features/chunked_loss``); a model has one."""
from __future__ import annotations

import contextlib
from typing import Any


class LossHead:
    """The engine's own: the forward returns the whole logits and the engine computes the loss from them."""

    def targets(self, targets, per_token: bool = False):
        """A context manager one micro-batch's forward runs in, given its shifted ``targets`` (the built-in step
        around the forward, a pipeline around its last stage's); ``per_token``: the caller wants each token's
        figures (``token_outputs``). The default: nothing to give."""
        return contextlib.nullcontext()

    def loss_sum(self, logits, targets) -> Any:
        """The token-loss sum the forward computed, found where the logits would be (``logits``: the model's
        output), or None for the engine's cross-entropy of the whole logits against ``targets``."""
        return None

    def token_outputs(self, logits, targets) -> Any:
        """Each token's log-probability, entropy and top-1 hit the forward computed (a
        ``distributed.loss.TokenOutputs``), or None for the engine's own from the whole logits."""
        return None

"""The training loop a front end will run with a layout (``TrainingLoop``), as ``ultrascale_validate_config`` is
given it to check (``engine.validate_loop``): each front end says its own before its first step (the recipe's
``train``, the Trainer's arguments, Lightning's ``Trainer``, Accelerate's accumulation). A dimension that cannot
run some loops (the optimizer step inside the backward: no accumulation, no clipping) refuses them there, in every
front end alike."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainingLoop:
    """``micro_batches``: forwards and backwards per optimizer step (gradient accumulation); ``max_grad_norm``: the
    global norm the gradients are clipped to, None when they are not clipped (0 arrives as None)."""

    micro_batches: int
    max_grad_norm: float | None

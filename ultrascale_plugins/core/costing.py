"""What a resolved layout costs one rank: the ``Estimate`` every plugin contributes to (``ultrascale_cost_estimate``)
and the ``Shape`` the dimensions leave (the inventory cut to this rank's share, the pipeline's layers). Below the
engine, so that ``engine.estimate`` (which checks the layout first) and the communication report of a running
model (``comm_report``, which has a resolved one) share it. The plugins' estimates run in the order of the stages'
names (``chains``): the pipeline's at ``split``, tensor parallel's at ``tp``, data parallel's at ``dp``."""
from __future__ import annotations

from typing import Any

from ..interface.config import ParallelConfig
from ..interface.estimates import Estimate, Shape, meta_model
from .chains import run_chain
from .inventory import adapted_inventory, inventory
from .plans import model_plan


def resolved_cost(resolved: ParallelConfig, model_config: Any, *, pm, seq_len: int = 2048, micro_batch: int = 1,
                  micro_batches: int = 1, coords: dict | None = None, model=None, profile: str = "ultrascale",
                  optimizer: str = "adamw", plan=None, **constants) -> tuple[Estimate, Shape]:
    """(estimate, shape) of ``resolved`` for ``model`` (real or on the meta device; default: built from
    ``model_config`` on the meta device) and its ``plan`` (default: the plugins'). ``coords`` picks the rank
    ({axis: index}; an axis left out: the most loaded rank along it)."""
    if model is None:
        model = meta_model(model_config)
    if plan is None:
        plan = model_plan(model, resolved, pm)
    records = inventory(model, plan, pm=pm)
    if constants.get("adapters") is not None:  # priced on a model that has none: their factors join the inventory
        records = adapted_inventory(records, model, constants["adapters"], pm)
    shape = Shape(model_config=model_config, seq_len=seq_len, micro_batch=micro_batch, micro_batches=micro_batches,
                  profile=profile, optimizer=optimizer, coords=dict(coords or {}), inventory=records,
                  model=model, plan=plan, **constants)
    est = Estimate(micro_batches=micro_batches)
    run_chain(pm, "ultrascale_cost_estimate", resolved, model_config, config=resolved, model_config=model_config,
              shape=shape, estimate=est)
    shape.seq_len = seq_len  # a step may narrow it to a rank's tokens (context parallel's); the shape says what it was for
    return est, shape

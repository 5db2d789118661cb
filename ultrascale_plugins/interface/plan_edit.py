"""What a plugin adds to, or takes from, a model's plan (``ultrascale_declare_plan_edit``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass
class PlanEdit:
    """``entries``: {module or parameter FQN (``*`` wildcards allowed), named from the model's root: a style name,
    or None to take the module out of the plan (a module the plugin wrapped, or claims for its own dimension)}.
    An entry names exactly what it shards: it is applied after the plan's own entries, so it wins over any of
    them that match the same name. ``styles``: style names this plugin introduces -> factory, as
    ``ModelPlan.styles`` (called with ``sequence_parallel=`` and ``loss_parallel=``); a factory with the attribute
    ``opens_region = True`` names a module that takes the hidden states whole on every TP rank and hands its output
    back whole (experts that another dimension places): the block around it becomes a TP region, whose input
    sequence parallel gathers and whose output it splits again. ``views``: {module FQN
    (wildcards allowed): the name of a ``parallel_dims.MeshView`` this plugin declares}: the module's parameters
    are data-parallel over that view's gradient axes instead of the layout's (ZeRO shards them there, in an FSDP
    group of their own; their gradients are summed there and divided by the layout's loss scale), e.g. experts
    placed by expert parallelism."""

    entries: dict[str, str | None] = dataclasses.field(default_factory=dict)
    styles: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    views: dict[str, str] = dataclasses.field(default_factory=dict)

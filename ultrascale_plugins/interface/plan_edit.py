"""What a plugin adds to, or takes from, a model's plan (``ultrascale_extend_plan``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass
class PlanEdit:
    """``entries``: {module or parameter FQN (``*`` wildcards allowed), named from the model's root: a style name,
    or None to take the module out of the plan (a module the plugin wrapped, or claims for its own dimension)}.
    An entry names exactly what it shards: it is applied after the plan's own entries, so it wins over any of
    them that match the same name. ``styles``: style names this plugin introduces -> factory, as
    ``ModelPlan.styles`` (called with ``sequence_parallel=`` and ``loss_parallel=``)."""

    entries: dict[str, str | None] = dataclasses.field(default_factory=dict)
    styles: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)

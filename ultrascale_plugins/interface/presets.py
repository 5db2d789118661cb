"""Named layouts for front ends whose users give only a name and a device count (``Trainer(strategy=NAME,
devices=N)``). The dimension plugins supply them through ``ultrascale_declare_presets`` — each a rule that picks the
degrees from the world size, the devices per node and the model — so a third party's dimension gets its own
Lightning strategy name with no change to the front ends. The front ends add one of their own: ``default``
(the layout in ``$ULTRASCALE_CONFIG`` if set, else ZeRO-3 over every device). The registry
(``core.registry``) collects them (``Registry.presets``) and makes a preset's layout (``Registry.preset_config``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable



@dataclasses.dataclass(frozen=True)
class Preset:
    """``layout(world, devices_per_node, model_config)`` returns the layout's fields."""

    name: str
    description: str
    layout: Callable[[int, int, Any], dict]


DEFAULT = Preset("default", "the planner's best layout for the devices, model and hardware (layout: auto), or "
                 "the layout in $ULTRASCALE_CONFIG", lambda world, per_node, model_config: {"layout": "auto"})


def largest_divisor(n: int, limit: int, ok: Callable[[int], bool] = lambda d: True) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` and passes ``ok`` (1 at least)."""
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0 and (d == 1 or ok(d)))

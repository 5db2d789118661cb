"""The model transform as named stages, and the one place their order is decided.

Every plugin that changes the model (splits it into pipeline stages, shards it, wraps its layers or the whole)
returns ``Stage`` descriptors from ``ultrascale_stages``: a name, the names it runs after and before, and the
function. ``order_stages`` sorts them by those declarations alone (a topological order); among stages free to run
at a point, the one whose plugin pluggy calls first (the last registered: a third party before the built-ins, the
built-ins in ``DEFAULT_PLUGINS``' reverse order) goes first, so the order is the same on every rank and every
run. So a stage that names nothing to run after may run first of all, before the pipeline's split (on the whole
model): a transform of each pipeline stage declares ``after=("split",)``. A name nobody declares, or a cycle, is refused before any process group, naming the plugins involved.

A plugin declares its stages whether or not the layout uses them (``active``), so ``after="cp"`` keeps its
meaning in a layout without context parallel, and ``describe`` shows only what runs.

The built-in order (see ``docs/writing-a-plugin.md``)::

    split (pp) -> float8 -> router_bias, gpt2_heads -> ep -> tp (+ sp) -> cp -> ac -> compile -> dp
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .config import ConfigError
from .ordering import as_names, order_by_names


@dataclasses.dataclass(frozen=True)
class Stage:
    """One model transform.

    ``run(model, ctx)`` transforms ``model`` — the whole model before a splitting stage, each of this rank's
    pipeline stages after it — with ``ctx`` the engine's ``ParallelContext``. A splitting stage (``splits``)
    returns ``(parts, runtime)`` (this rank's pipeline stages and the ``Runtime`` that runs them) or None.
    ``after`` / ``before``: names of stages this one runs after / before. ``axes``: the mesh axes it uses;
    ``does``: one line on what it does to the model (``describe``). ``active``: whether this layout uses it."""

    name: str
    run: Callable[..., Any]
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    axes: tuple[str, ...] = ()
    does: str = ""
    active: bool = True
    splits: bool = False
    plugin: str = ""  # filled in by ``collect_stages``: the plugin that declared it

    def __post_init__(self):  # a single name may be given as a plain string
        object.__setattr__(self, "after", as_names(self.after))
        object.__setattr__(self, "before", as_names(self.before))


def collect_stages(pm, config, model_config) -> list[Stage]:
    """Every plugin's stages for ``config`` and ``model_config``, in pluggy's call order, each tagged with its
    plugin's name."""
    out: list[Stage] = []
    given = {"config": config, "model_config": model_config}
    for impl in reversed(pm.hook.ultrascale_stages.get_hookimpls()):  # pluggy calls from the end of this list
        if impl.hookwrapper or impl.wrapper:
            raise ConfigError(f"plugin {impl.plugin_name} wraps ultrascale_stages: stages are ordered by their "
                              "after/before names, not by wrapping. Fix: return Stage objects from a plain hookimpl")
        # called per plugin to know whose stage is whose; with the arguments it takes, as pluggy would
        for stage in impl.function(**{k: v for k, v in given.items() if k in impl.argnames}) or ():
            out.append(dataclasses.replace(stage, plugin=impl.plugin_name))
    return out


def order_stages(stages: list[Stage]) -> list[Stage]:
    """``stages`` in an order that honours every ``after`` and ``before`` (``ordering.order_by_names``: ties go to
    the earlier in the list). Raises ``ConfigError`` for a name declared twice, a name nobody declares, or a
    cycle."""
    return order_by_names(stages, lambda s: s.plugin, "stage", "stages", verb="runs")


def describe_stages(stages: list[Stage]) -> str:
    """The active stages in order, one line each: name, mesh axes, what it does, plugin."""
    rows = [s for s in stages if s.active]
    width = max((len(s.name) for s in rows), default=4)
    lines = []
    for i, stage in enumerate(rows, 1):
        axes = ",".join(stage.axes) or "-"
        lines.append(f"{i:>2}. {stage.name:<{width}}  [{axes}]  {stage.does}  ({stage.plugin})")
    return "\n".join(lines) if lines else "(no stage: the model runs as it is)"

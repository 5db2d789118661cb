"""The model transform as named stages, and the one place their order is decided.

Every plugin that changes the model (splits it into pipeline stages, shards it, wraps its layers or the whole)
returns ``Stage`` descriptors from ``ultrascale_transform_stages``: a name, the names it runs after and before, and the
function. ``order_stages`` sorts them by those declarations alone (a topological order); among stages free to run
at a point, the one whose plugin pluggy calls first (the last registered: a third party before the built-ins, the
built-ins in ``DEFAULT_PLUGINS``' reverse order) goes first, so the order is the same on every rank and every
run. So a stage that names nothing to run after may run first of all, before the pipeline's split (on the whole
model): a transform of each pipeline stage declares ``after=("split",)``. A name nobody declares, or a cycle, is refused before any process group, naming the plugins involved.

A plugin declares its stages whether or not the layout uses them (``active``), so ``after="cp"`` keeps its
meaning in a layout without context parallel, and ``describe`` shows only what runs.

The built-in order (see ``docs/writing-a-plugin.md``)::

    split (pp) -> float8 -> router_bias, gpt2_heads -> ep -> tp (+ sp) -> cp -> ac -> compile -> dp

The same names order the two chains that hand one object from plugin to plugin: the cost chain
(``ultrascale_cost_estimate``, which cuts ``shape.inventory`` in turn) and the batch split (``ultrascale_step_shard_batch``).
An implementation says where it runs with ``@step(name, after=, before=)`` (a ``Step``): at a stage's name alone,
where that stage runs; at a name of its own, placed by its after/before among the stages like one. ``order_chain``
gives the order; the engine (``core/chains.py``) collects the implementations and runs them in it.
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
    plugin: str = ""  # filled in by the registry (``Registry.stages``): the plugin that declared it

    def __post_init__(self):  # a single name may be given as a plain string
        object.__setattr__(self, "after", as_names(self.after))
        object.__setattr__(self, "before", as_names(self.before))


@dataclasses.dataclass(frozen=True)
class Step:
    """Where one implementation of a chain hook (``ultrascale_cost_estimate``, ``ultrascale_step_shard_batch``) runs.

    ``name`` alone, a stage's name: at that stage's place (``Step("tp")``: where tensor parallel shards the
    model). A name of its own: placed by ``after`` / ``before`` (stage or step names) like a stage. ``plugin`` and
    ``run`` (the implementation, called with the hook's arguments) are filled in by the engine; an implementation
    that declares no step gets one named after it (``declared`` False) that runs after every declared one."""

    name: str
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    plugin: str = ""
    run: Callable[..., Any] | None = None
    declared: bool = True

    def __post_init__(self):  # a single name may be given as a plain string
        object.__setattr__(self, "after", as_names(self.after))
        object.__setattr__(self, "before", as_names(self.before))


STEP_MARK = "ultrascale_step"  # the attribute ``step`` sets on the function it marks


def step(name: str, *, after: str | tuple[str, ...] = (), before: str | tuple[str, ...] = ()):
    """Mark an implementation of ``ultrascale_cost_estimate`` or ``ultrascale_step_shard_batch`` with its place::

        @hookimpl
        @step("acme_grads", after="tp")
        def ultrascale_cost_estimate(config, model_config, shape, estimate): ...
    """
    def mark(function):
        setattr(function, STEP_MARK, Step(name, after, before))
        return function
    return mark


def order_stages(stages: list[Stage]) -> list[Stage]:
    """``stages`` in an order that honours every ``after`` and ``before`` (``ordering.order_by_names``: ties go to
    the earlier in the list). Raises ``ConfigError`` for a name declared twice, a name nobody declares, or a
    cycle."""
    return order_by_names(stages, lambda s: s.plugin, "stage", "stages", verb="runs")


def order_chain(stages: list[Stage], steps: list[Step]) -> list[Step]:
    """``steps`` in the order of the stages' names: a step at a stage's name (no after/before of its own) runs at
    that stage's place, the others are placed among the stages by their after/before, the undeclared ones last.
    Steps at one place keep their order in ``steps``. Raises ``ConfigError`` as ``order_stages`` does, and for a
    step at a stage's name that declares after/before too."""
    names = {s.name for s in stages}
    at: dict[str, list[Step]] = {}
    own: list[Step] = []
    for s in steps:
        if s.name in names and (s.after or s.before):
            raise ConfigError(f"step '{s.name}' of {s.plugin} runs at the stage '{s.name}' and declares after/before "
                              "too. Fix: drop its after/before, or give the step a name of its own")
        (at.setdefault(s.name, []) if s.name in names else own).append(s)
    # an undeclared step names nothing and nothing names it: listed last, Kahn's ties place it after all the others
    own.sort(key=lambda s: not s.declared)
    out: list[Step] = []
    for node in order_by_names(list(stages) + own, lambda s: s.plugin, "step", "steps", verb="runs"):
        out.extend(at.get(node.name, ()) if isinstance(node, Stage) else (node,))
    return out


def placement(item) -> str:
    """``item``'s declared place, for ``describe``: "after a,b; before c", or "" when it declares none."""
    parts = [f"{word} {','.join(names)}" for word, names in (("after", item.after), ("before", item.before)) if names]
    return "; ".join(parts)


def describe_stages(stages: list[Stage]) -> str:
    """The active stages in order, one line each: name, mesh axes, what it does, plugin, its after / before."""
    rows = [s for s in stages if s.active]
    width = max((len(s.name) for s in rows), default=4)
    lines = []
    for i, stage in enumerate(rows, 1):
        axes = ",".join(stage.axes) or "-"
        where = f"  [{placement(stage)}]" if placement(stage) else ""
        lines.append(f"{i:>2}. {stage.name:<{width}}  [{axes}]  {stage.does}  ({stage.plugin}){where}")
    return "\n".join(lines) if lines else "(no stage: the model runs as it is)"


def describe_chain(steps: list[Step], stages: list[Stage]) -> str:
    """A chain's steps in order, one line each: the place (a stage's, with that stage's after / before, or the
    step's own), the plugin."""
    declared = {s.name: s for s in stages}
    width = max((len(s.name) for s in steps), default=4)
    lines = []
    for i, s in enumerate(steps, 1):
        where = placement(declared.get(s.name, s)) if s.declared else "undeclared: after the others"
        kind = "stage" if s.name in declared else "step"
        lines.append(f"{i:>2}. {s.name:<{width}}  ({kind}{': ' + where if where else ''})  ({s.plugin})")
    return "\n".join(lines) if lines else "(none)"

"""The one way the plugins' declarations are put in order: each names the others it comes ``after`` and
``before``, and ``order_by_names`` sorts them by those names alone (a topological order). The model transforms
(``stages.Stage``) and the mesh axes (``mesh_axes.MeshAxis``) are both ordered here, so a third party places its
stage or its axis among the built-ins the same way: by name, never by a number or by registration order."""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from .fields import ConfigError

T = TypeVar("T")


def as_names(value: str | Sequence[str]) -> tuple[str, ...]:
    """``after`` / ``before`` as a tuple of names: a single name may be given as a plain string."""
    return (value,) if isinstance(value, str) else tuple(value)


def order_by_names(items: Sequence[T], owner: Callable[[T], str], kind: str, kinds: str,
                   verb: str = "comes") -> list[T]:
    """``items`` (each with ``name``, ``after`` and ``before``) in an order that honours every ``after`` and
    ``before`` (Kahn's algorithm; ties go to the earlier in ``items``, so the order is the same on every rank and
    every run). ``owner(item)`` is the plugin that declared it; ``kind`` / ``kinds`` name one item and several in
    the messages, ``verb`` what an item does after another ("runs" for stages). Raises a one-line ``ConfigError``
    naming the plugins for a name declared twice, a name nobody declares, or a cycle."""
    by_name: dict[str, T] = {}
    for item in items:
        if item.name in by_name:
            raise ConfigError(f"{kind} '{item.name}' is declared by both {owner(by_name[item.name])} and "
                              f"{owner(item)}. Fix: rename one, or unregister one of them (ULTRASCALE_PLUGINS)")
        by_name[item.name] = item
    edges: dict[str, set[str]] = {name: set() for name in by_name}  # name -> the names that must come first
    for item in items:
        for other, first in [(o, True) for o in item.after] + [(o, False) for o in item.before]:
            if other not in by_name:
                raise ConfigError(f"{kind} '{item.name}' of {owner(item)} {verb} {'after' if first else 'before'} "
                                  f"'{other}', which no plugin declares. Fix: use one of {', '.join(sorted(by_name))}")
            if first:
                edges[item.name].add(other)
            else:
                edges[other].add(item.name)
    done: list[T] = []
    placed: set[str] = set()
    waiting = list(items)
    while waiting:
        ready = next((item for item in waiting if edges[item.name] <= placed), None)
        if ready is None:
            cycle = _cycle(edges, [item.name for item in waiting])
            who = ", ".join(f"'{n}' ({owner(by_name[n])})" for n in cycle)
            raise ConfigError(f"the {kinds} {who} each wait for another: a cycle in their after/before. Fix: drop "
                              "one of those declarations")
        done.append(ready)
        placed.add(ready.name)
        waiting.remove(ready)
    return done


def _cycle(edges: dict[str, set[str]], names: list[str]) -> list[str]:
    """One cycle among ``names`` (each waits for one of the others), as a path."""
    path, seen = [names[0]], {names[0]: 0}
    while True:
        nxt = sorted(n for n in edges[path[-1]] if n in names)[0]
        if nxt in seen:
            return path[seen[nxt]:] + [nxt]
        seen[nxt] = len(path)
        path.append(nxt)

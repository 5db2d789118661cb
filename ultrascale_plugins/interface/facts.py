"""What one family decided that another needs to know, as one object.

A family reads another's decisions here, never through that family's layout fields: the degree of a mesh axis
by the axis's name, and the facts the plugins declare. Each fact has one owner, the plugin that declares it
(``fields.fact`` in ``ultrascale_declare_fields``, with the value that holds by default) and answers it from its own
fields in ``ultrascale_declare_facts``. torchtitan passes the same couplings as explicit arguments
(``enable_float8_tensorwise_tp``, ``cp_enabled``); here they travel in one object, so a third-party dimension
publishes its own the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping



@dataclasses.dataclass(frozen=True)
class LayoutFacts:
    """The layout's mesh degrees and the facts the plugins decided (``layout_facts(config)`` makes it), read as
    attributes: ``facts.degree("tp")``, ``facts.fsdp_shards``. The facts are open: each is declared by the plugin that
    owns it (``fields.fact(name, default, help)`` in ``ultrascale_declare_fields``) and answered by that plugin alone
    (``ultrascale_declare_facts``), so this type lists none; ``us.list_plugins()`` and docs/writing-a-plugin.md list
    the built-in ones. ``values``: every declared fact's value for this layout."""

    degrees: Mapping[str, int] = dataclasses.field(default_factory=dict)
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("degrees", "values"):
            raise AttributeError(name)
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(f"no installed plugin declares the layout fact '{name}'. Fix: install the plugin "
                                 f"that owns it (declared: {', '.join(sorted(self.values)) or 'none'})") from None

    def degree(self, axis: str) -> int:
        """The degree of a mesh axis (a view's too), by name: 1 when no plugin declares it, -1 before a layout
        is resolved for the axis that takes the rest of the world."""
        return self.degrees.get(axis, 1)


def layout_facts(config) -> LayoutFacts:
    """The facts of ``config`` (resolved or not), as the registry it was made under derives them from the plugins'
    ``ultrascale_declare_facts`` answers (``config.registry.facts``)."""
    return config.registry.facts(config)

"""The plugin manager: built-in dimensions first, then entry-point plugins from the ``ultrascale_plugins`` group.

``ULTRASCALE_PLUGINS`` restricts which entry-point plugins load: a comma-separated list of entry-point names
(an empty value loads none). Built-ins always load.
"""
from __future__ import annotations

import importlib
import os

import pluggy

from . import hookspecs

ENTRY_POINT_GROUP = "ultrascale_plugins"
ENV_VAR = "ULTRASCALE_PLUGINS"

# Built-in plugins, registered exactly like third-party ones. Listed from the one whose hooks run last to the one
# whose hooks run first: each gets the position 100 x (its place from the end), see ``position``.
DEFAULT_PLUGINS = (
    "ultrascale_plugins.dims.data_parallel",
    "ultrascale_plugins.dims.tensor",
    "ultrascale_plugins.dims.pipeline",
    "ultrascale_plugins.dims.context_parallel",
    "ultrascale_plugins.dims.expert_parallel",
    "ultrascale_plugins.dims.checkpointing",
    "ultrascale_plugins.dims.compiling",
    "ultrascale_plugins.dims.float8",
    "ultrascale_plugins.models.hf_plan",
    "ultrascale_plugins.models.gpt2",
    "ultrascale_plugins.models.peft_adapters",
    "ultrascale_plugins.models.peft_checkpoints",
    "ultrascale_plugins.models.peft_meta",
    "ultrascale_plugins.models.quantized_base",
    "ultrascale_plugins.models.router_aux_loss",
    "ultrascale_plugins.models.router_bias",
    "ultrascale_plugins.step",
    "ultrascale_plugins.planner.auto",
)

BUILTIN_POSITIONS = {name: 100 * (len(DEFAULT_PLUGINS) - i) for i, name in enumerate(DEFAULT_PLUGINS)}
POSITION_ATTR = "ultrascale_position"


def position(where: float):
    """Decorator for a hook implementation: where it runs among every plugin's implementations of that hook,
    whatever order the plugins were registered in. Smaller runs first; the built-ins sit at 100, 200, ...
    (``BUILTIN_POSITIONS``: e.g. tensor parallel's ``ultrascale_shard_model`` at 1600, data parallel's
    ``ultrascale_wrap_model`` at 1700), an implementation without a position at 0 (before the built-ins).
    ``tryfirst`` / ``trylast`` still put an implementation before / after all others; equal positions run in
    the order of the plugins' names. Use it under ``@hookimpl``::

        @hookimpl
        @position(1650)   # after tensor parallel has sharded the layers, before data parallel wraps them
        def ultrascale_shard_model(model, ctx): ...
    """
    def mark(function):
        setattr(function, POSITION_ATTR, where)
        return function

    return mark


def _position(impl) -> float:
    explicit = getattr(impl.function, POSITION_ATTR, None)
    return explicit if explicit is not None else BUILTIN_POSITIONS.get(impl.plugin_name, 0)


def order_hooks(pm: pluggy.PluginManager) -> None:
    """Put every hook's implementations in their declared order (``position``), replacing pluggy's (the last
    registered runs first), so the call order never depends on when a plugin was registered."""
    from pluggy import HookCaller

    def key(impl):
        band = 0 if impl.tryfirst else 2 if impl.trylast else 1
        return band, _position(impl), impl.plugin_name

    for caller in vars(pm.hook).values():
        if not isinstance(caller, HookCaller):
            continue
        impls = list(caller._hookimpls)  # pluggy calls them from the end of this list
        plain = sorted((i for i in impls if not (i.hookwrapper or i.wrapper)), key=key, reverse=True)
        wrappers = sorted((i for i in impls if i.hookwrapper or i.wrapper), key=key, reverse=True)
        caller._hookimpls[:] = plain + wrappers


_manager: pluggy.PluginManager | None = None
_fields = None  # the layout fields of the process-wide manager's plugins (dropped when plugins change)


def _allowed_entry_points() -> set[str] | None:
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def make_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if load_entry_points:
        allowed = _allowed_entry_points()
        if allowed is None:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        else:
            for name in sorted(allowed):
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
    pm.check_pending()  # an ultrascale_* hook with no specification fails here, not silently later
    order_hooks(pm)
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    global _manager
    if _manager is None:
        _manager = make_plugin_manager()
    return _manager


def layout_fields():
    """Every layout field the installed plugins declare (``fields.Fields``)."""
    global _fields
    if _fields is None:
        from .fields import collect

        _fields = collect(get_plugin_manager())
    return _fields


def register(plugin, name: str | None = None) -> None:
    """Register a plugin object or module in the process-wide manager (tests, notebooks, scripts)."""
    global _fields
    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    pm.check_pending()
    order_hooks(pm)
    _fields = None


def unregister(plugin=None, name: str | None = None) -> None:
    global _fields
    get_plugin_manager().unregister(plugin=plugin, name=name)
    _fields = None


def list_plugins() -> list[dict]:
    """One entry per registered plugin: name, where it comes from, version, the hooks it implements and the layout
    fields it declares."""
    pm = get_plugin_manager()
    dists = {id(p): d for p, d in pm.list_plugin_distinfo()}
    rows = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        dist = dists.get(id(plugin))
        if dist is not None:
            source, version = dist.project_name, dist.version
        else:
            from .. import __version__

            source, version = "builtin", __version__
        fields = [f for f in layout_fields() if f.plugin == name]
        rows.append({"name": name, "source": source, "version": version, "hooks": hooks, "fields": fields})
    return rows

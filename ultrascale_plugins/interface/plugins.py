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

# Built-in plugins, registered exactly like third-party ones, in this order. pluggy calls a hook's implementations
# from the last registered to the first (``tryfirst`` / ``trylast`` aside): so the planner's first, data parallel's
# last, and a third-party plugin (registered after these) before them all. The model transforms are ordered by
# name instead (``interface.stages``), not by this list.
DEFAULT_PLUGINS = (
    "ultrascale_plugins.dims.data_parallel.plugin",
    "ultrascale_plugins.dims.tensor.plugin",
    "ultrascale_plugins.dims.pipeline.plugin",
    "ultrascale_plugins.dims.context.plugin",
    "ultrascale_plugins.dims.expert.plugin",
    "ultrascale_plugins.features.activation_checkpointing.plugin",
    "ultrascale_plugins.features.compile.plugin",
    "ultrascale_plugins.features.float8.plugin",
    "ultrascale_plugins.features.chunked_loss.plugin",
    "ultrascale_plugins.features.optimizer_in_backward.plugin",
    "ultrascale_plugins.features.activation_offload.plugin",
    "ultrascale_plugins.models.hf_plan",
    "ultrascale_plugins.models.gpt2",
    "ultrascale_plugins.features.peft.adapters",
    "ultrascale_plugins.features.peft.pricing",
    "ultrascale_plugins.features.peft.wrapper",
    "ultrascale_plugins.features.peft.checkpoints",
    "ultrascale_plugins.features.peft.meta",
    "ultrascale_plugins.features.peft.quantized_base",
    "ultrascale_plugins.features.peft.recipe_section",
    "ultrascale_plugins.features.routers.aux_loss",
    "ultrascale_plugins.features.routers.bias",
    "ultrascale_plugins.core.step",
    "ultrascale_plugins.planner.auto",
)


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
        else:  # the package's own, as an entry point's version comes from its distribution
            from importlib.metadata import version as installed_version

            source, version = "builtin", installed_version("ultrascale-plugins")
        fields = [f for f in layout_fields() if f.plugin == name]
        rows.append({"name": name, "source": source, "version": version, "hooks": hooks, "fields": fields})
    return rows

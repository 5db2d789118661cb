"""The registry: the installed plugins and everything derived from what they declare, one object that is passed.

``Registry`` is a pluggy ``PluginManager`` (pytest's ``PytestPluginManager`` is the model) that also answers the
questions every layer asks of the plugins: the layout fields (``fields``), a config's mesh axes and views
(``axes`` / ``views``), its resolution against a world size (``resolve``), the facts the families decide for each
other (``facts``), the model transforms (``stages``), the presets and the libraries of model wrappers (a model's
wrapper, its adapters' prices, its exports). ``interface/`` describes these values and never runs a hook; the
engine, the planner and the checkpoints are handed a registry, as Megatron hands its process groups around
(``ProcessGroupCollection``) instead of reading a global.

A config is made under one registry (``registry.config(...)``, or ``ParallelConfig(...)`` under the default) and
keeps it: the families reach the registry through the config their hooks are given, never through a global.

``BUILTIN_PLUGINS`` are registered exactly like a third party's, first, then the ``ultrascale_plugins`` entry
points (``ULTRASCALE_PLUGINS`` restricts those to a comma-separated list of names; empty: none). The one
process-wide registry (``default_registry``) belongs to the front-end edge: the public API (``us.parallelize``,
``us.register``), the command line and the integrations.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import os

import pluggy

from ..interface import hookspecs
from ..interface.config import ConfigError, ParallelConfig
from ..interface.facts import LayoutFacts
from ..interface.fields import AUTO, Fields
from ..interface.mesh_axes import MeshAxis, MeshView, resolved_view
from ..interface.model_wrapper import ModelWrapper, WrapperLibrary
from ..interface.presets import DEFAULT, Preset
from ..interface.stages import Stage

ENTRY_POINT_GROUP = "ultrascale_plugins"
ENV_VAR = "ULTRASCALE_PLUGINS"

# Registered in this order. pluggy calls a hook's implementations from the last registered to the first: the
# planner's first, data parallel's last, a third party's (registered after these) before them all. The model
# transforms, the cost chain and the batch split are ordered by name instead (``interface.stages``).
BUILTIN_PLUGINS = (
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


class Registry(pluggy.PluginManager):
    """The plugins of one process (or one test), with what they declare. Derived answers are cached until a plugin
    is registered or unregistered (pluggy's ``load_setuptools_entrypoints`` registers through ``register`` too)."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self._cache: dict = {}

    # ---- what the plugins declare, cached per set of plugins -----------------------------------------------
    def _cached(self, what, key, make):
        table = self._cache.setdefault(what, {})
        try:
            return table[key]
        except KeyError:
            table[key] = value = make()
            return value

    @property
    def fields(self) -> Fields:
        """Every layout field the plugins declare (``ultrascale_declare_fields``), each with its plugin's name."""
        return self._cached("fields", None, self._collect_fields)

    def _collect_fields(self) -> Fields:
        fields = Fields()
        for impl in self.hook.ultrascale_declare_fields.get_hookimpls():  # registration order, each plugin's own
            fields.plugin = impl.plugin_name
            impl.function(fields=fields)
        fields.plugin = ""
        return fields

    def config(self, **values) -> ParallelConfig:
        """A layout of this registry's fields (unknown or invalid values refused, naming the field)."""
        return ParallelConfig(self, **values)

    # ---- the mesh ----------------------------------------------------------------------------------------
    def declared(self, config) -> tuple[list[MeshAxis], list[MeshView]]:
        """Every plugin's axes (outermost first, as their ``after`` / ``before`` place them) and views for
        ``config`` (``ultrascale_declare_mesh_axes``); an axis or view declared twice, a value of another type, a name
        no plugin declares or a cycle is refused, naming the plugins. Cached per config (the planner asks for
        thousands)."""
        try:
            axes, views = self._cached("declared", config, lambda: self._declared(config))
        except TypeError:  # an unhashable stand-in for a config
            axes, views = self._declared(config)
        return list(axes), list(views)

    def _declared(self, config) -> tuple[list[MeshAxis], list[MeshView]]:
        from ..interface.ordering import order_by_names

        axes: dict[str, MeshAxis] = {}
        views: dict[str, MeshView] = {}
        for result in self.hook.ultrascale_declare_mesh_axes(config=config):
            for axis in result or []:
                if not isinstance(axis, (MeshAxis, MeshView)):
                    raise ConfigError(f"a plugin's ultrascale_declare_mesh_axes returned {axis!r}. Fix: return "
                                      "MeshAxis or MeshView values")
                seen = views if isinstance(axis, MeshView) else axes
                if axis.name in seen:
                    what = "view" if isinstance(axis, MeshView) else "axis"
                    raise ConfigError(f"mesh {what} '{axis.name}' is declared by both "
                                      f"{' and '.join(self._declarers(config, axis.name))}. Fix: rename one of them")
                seen[axis.name] = axis
        ordered = order_by_names(list(axes.values()), lambda a: " and ".join(self._declarers(config, a.name)),
                                 "mesh axis", "mesh axes", verb="lies")
        return ordered, list(views.values())

    def _declarers(self, config, name: str) -> list[str]:
        """The plugins whose ``ultrascale_declare_mesh_axes`` declares ``name``, in pluggy's call order (for a refusal's
        message only: each plugin's hook is called alone, through pluggy)."""
        out = []
        everyone = self.get_plugins()
        hook = "ultrascale_declare_mesh_axes"
        for impl in reversed(getattr(self.hook, hook).get_hookimpls()):  # pluggy calls from the list's end
            alone = self.subset_hook_caller(hook, [p for p in everyone if p is not impl.plugin])
            if any(axis.name == name for result in alone(config=config) for axis in result or []):
                out.append(impl.plugin_name)
        return out

    def axes(self, config) -> list[MeshAxis]:
        """Every plugin's axes for ``config``, outermost first."""
        return self.declared(config)[0]

    def views(self, config, axes: list[MeshAxis] | None = None) -> list[MeshView]:
        """Every plugin's views for ``config`` (resolved), each with its -1 degree filled in and checked against
        the axes it is carved from."""
        own_axes, views = self.declared(config)
        return [resolved_view(view, axes if axes is not None else own_axes) for view in views]

    # ---- resolving a layout --------------------------------------------------------------------------------
    def resolve(self, config, world_size: int, check: bool = True) -> ParallelConfig:
        """``config`` with its ``-1`` degree filled in, after checking the axes' product against the world size
        and running every plugin's field checks that need no model (``ultrascale_validate_config``; ``check=False``
        skips them: the planner costs layouts this engine cannot run)."""
        config = config.under(self)
        axes = self.axes(config)
        free = [a for a in axes if a.degree == -1]
        fixed = [a for a in axes if a.degree != -1]
        product = math.prod(a.degree for a in fixed)
        if len(free) > 1:
            raise ConfigError(f"{' and '.join(a.name for a in free)} are both -1: only one degree can take the rest "
                              "of the world. Fix: give all but one of them a number")
        if free:
            if world_size % product:
                names = "*".join(a.name for a in fixed)
                raise ConfigError(f"{names} = {'*'.join(str(a.degree) for a in fixed)} = {product} does not divide "
                                  f"the world size {world_size}. Fix: pick degrees whose product divides {world_size}")
            config = config.replace(**{free[0].name: world_size // product})
        elif product != world_size:
            formula, values = "*".join(a.name for a in axes), "*".join(str(a.degree) for a in axes)
            raise ConfigError(f"{formula} = {values} = {product} but the world size is {world_size}. Fix: make the "
                              f"product {world_size}, or set dp_shard: -1 to use the rest")
        config = self.fill_auto(config)
        if check:
            self.hook.ultrascale_validate_config(config=config, model_config=None, world_size=world_size, loop=None)
        self.views(config)  # a view that cannot re-split its source is refused here too
        return config

    def fill_auto(self, config) -> ParallelConfig:
        """``config`` with every field set to ``"auto"`` replaced by what its plugin derives from the (resolved)
        degrees, e.g. ``sequence_parallel: auto`` -> on whenever ``tp > 1``."""
        derived = {f.name: f.auto(config) for f in self.fields if f.auto is not None
                   and getattr(config, f.name, None) == AUTO}
        return config.replace(**derived) if derived else config

    def facts(self, config) -> LayoutFacts:
        """The facts of ``config`` (resolved or not): its axes' degrees and every plugin's answers to
        ``ultrascale_declare_facts``, each fact at its owner's default unless the owner answers it; a fact no plugin
        declares, or one answered by a plugin other than its owner, is refused naming the plugins."""
        try:
            return self._cached("facts", config, lambda: self._facts(config))
        except TypeError:  # an unhashable stand-in for a config: not cached
            return self._facts(config)

    def _facts(self, config) -> LayoutFacts:
        axes, views = self.declared(config)
        degrees = {a.name: a.degree for a in axes}
        for view in views:
            degrees.update({a.name: a.degree for a in view.axes})
        declared = self.fields.facts
        values = {name: fact.default for name, fact in declared.items()}
        for impl in self.hook.ultrascale_declare_facts.get_hookimpls():  # registration order: each plugin's own
            answer = impl.function(config=config, degrees=degrees) or {}
            for name, value in answer.items():
                if name not in declared:
                    raise ConfigError(f"plugin '{impl.plugin_name}' answers the layout fact '{name}', which no "
                                      "plugin declares. Fix: declare it in its ultrascale_declare_fields "
                                      f"(fields.fact('{name}', default, help)), or answer one of {', '.join(declared)}")
                if declared[name].plugin != impl.plugin_name:
                    raise ConfigError(f"the layout fact '{name}' is declared by '{declared[name].plugin}' and answered "
                                      f"by '{impl.plugin_name}'. Fix: leave it to its owner, or declare a fact of "
                                      "your own")
                values[name] = value
        return LayoutFacts(degrees=degrees, values=values)

    # ---- the model -------------------------------------------------------------------------------------------
    def stages(self, config, model_config) -> list[Stage]:
        """Every plugin's stages for ``config`` and ``model_config``, in pluggy's call order, each tagged with
        its plugin's name (``interface.stages.order_stages`` puts them in order)."""
        out: list[Stage] = []
        given = {"config": config, "model_config": model_config}
        for impl in reversed(self.hook.ultrascale_transform_stages.get_hookimpls()):  # pluggy calls from the list's end
            if impl.hookwrapper or impl.wrapper:
                raise ConfigError(f"plugin {impl.plugin_name} wraps ultrascale_transform_stages: stages are ordered "
                                  "by their after/before names, not by wrapping. Fix: return Stage objects from a "
                                  "plain hookimpl")
            # called per plugin to know whose stage is whose; with the arguments it takes, as pluggy would
            for stage in impl.function(**{k: v for k, v in given.items() if k in impl.argnames}) or ():
                out.append(dataclasses.replace(stage, plugin=impl.plugin_name))
        return out

    def wrapper_libraries(self) -> list[WrapperLibrary]:
        """Every plugin's library of model wrappers (``ultrascale_declare_model_wrapper``: PEFT's), in pluggy's call
        order, asked once per set of plugins; a value of another type is refused."""
        return self._cached("wrapper_libraries", None, self._collect_wrapper_libraries)

    def _collect_wrapper_libraries(self) -> list[WrapperLibrary]:
        libraries = self.hook.ultrascale_declare_model_wrapper()
        for library in libraries:
            if not isinstance(library, WrapperLibrary):
                raise ConfigError(f"a plugin's ultrascale_declare_model_wrapper returned {library!r}. Fix: return "
                                  "a model_wrapper.WrapperLibrary, or None")
        return libraries

    def wrapper_of(self, model) -> ModelWrapper:
        """The first library's description of ``model`` (``WrapperLibrary.wrap``), or a wrapper of nothing."""
        wrapper = next((w for w in (lib.wrap(model) for lib in self.wrapper_libraries()) if w is not None), None)
        return wrapper if wrapper is not None else ModelWrapper(model)

    # ---- the front ends' names -------------------------------------------------------------------------------
    def presets(self) -> dict[str, Preset]:
        """Every preset: ``default`` first, then the plugins' in registration order."""
        out = {DEFAULT.name: DEFAULT}
        for result in reversed(self.hook.ultrascale_declare_presets()):
            for preset in result or []:
                if preset.name in out:
                    raise ConfigError(f"preset '{preset.name}' is declared twice. Fix: rename one of them")
                out[preset.name] = preset
        return out

    def preset_config(self, name: str, world: int, devices_per_node: int, model_config) -> ParallelConfig:
        """The layout the preset ``name`` picks for the world, the devices per node and the model."""
        table = self.presets()
        if name not in table:
            raise ConfigError(f"preset={name!r}: unknown. Fix: one of {', '.join(table)}")
        return self.config(**table[name].layout(world, devices_per_node, model_config))

    def plugins(self) -> list[dict]:
        """One entry per registered plugin: name, where it comes from, version, the hooks it implements and the
        layout fields it declares."""
        from importlib.metadata import version as installed_version

        dists = {id(p): d for p, d in self.list_plugin_distinfo()}
        rows = []
        for name, plugin in self.list_name_plugin():
            if plugin is None:
                continue
            hooks = sorted(h.name for h in self.get_hookcallers(plugin) or [])
            dist = dists.get(id(plugin))
            source, version = ((dist.project_name, dist.version) if dist is not None
                               else ("builtin", installed_version("ultrascale-plugins")))
            rows.append({"name": name, "source": source, "version": version, "hooks": hooks,
                         "fields": [f for f in self.fields if f.plugin == name]})
        return rows

    def register(self, plugin, name: str | None = None):
        """Register ``plugin`` (an object or module implementing ``ultrascale_*`` hooks); an implementation that
        matches no hookspec fails here, not silently later."""
        self._cache = {}
        registered = super().register(plugin, name=name)
        self.check_pending()
        return registered

    def unregister(self, plugin=None, name: str | None = None):
        """Remove a plugin (by object or by name); returns it."""
        self._cache = {}
        return super().unregister(plugin=plugin, name=name)


def _allowed_entry_points() -> set[str] | None:
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def make_registry(load_entry_points: bool = True) -> Registry:
    """A registry of the built-in plugins and (``load_entry_points``) the installed entry points."""
    registry = Registry()
    for name in BUILTIN_PLUGINS:
        registry.register(importlib.import_module(name), name=name)
    if load_entry_points:
        allowed = _allowed_entry_points()
        if allowed is None:
            registry.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        else:
            for name in sorted(allowed):
                registry.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
    registry.check_pending()  # an ultrascale_* hook with no specification fails here
    return registry


# ---- the front-end edge: one process-wide registry ----------------------------------------------------------
_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry the public API, the command line and the integrations use (made on first use).
    Below the front ends, a registry is passed."""
    global _default
    if _default is None:
        _default = make_registry()
    return _default


def given_or_default(pm: Registry | None) -> Registry:
    """``pm``, or the process-wide registry for a caller at the front-end edge that gives none (a script reading
    weights, ``ultrascale plan`` / ``export``, a recipe read from its file)."""
    return pm if pm is not None else default_registry()


ParallelConfig.default_registry = staticmethod(default_registry)  # what a config made without one is made under

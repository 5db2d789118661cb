"""ParallelConfig: the one layout description shared by every front end.

Its fields are whatever the installed dimension plugins declare through ``ultrascale_declare_fields`` (see
``fields.py``): the built-ins declare ``dp_replicate``, ``dp_shard``, ``zero_stage``, ``mixed_precision`` (data
parallel), ``tp``, ``sequence_parallel``, ``loss_parallel`` (tensor parallel), ``pp`` and its schedule fields
(pipeline), ``activation_checkpointing``, ``cp`` and ``cp_method`` (context parallel); a third-party plugin's fields join them. Values are checked when the
config is made, so a bad layout fails in milliseconds, before any process group, with an error that names the
field, the value and the fix.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from .fields import ConfigError, Fields, field_error, suggest  # noqa: F401 - re-exported: every module's error type

if TYPE_CHECKING:
    from .facts import LayoutFacts
    from .mesh_axes import MeshAxis, MeshView


class LayoutRegistry(Protocol):
    """What a config asks of the registry it was made under (``core.registry.Registry`` is the one the package
    makes): the plugins' fields, and what they declare for a layout."""

    fields: Fields

    def axes(self, config: "ParallelConfig") -> list["MeshAxis"]:
        """The plugins' mesh axes for ``config``, outermost first."""

    def views(self, config: "ParallelConfig", axes: list["MeshAxis"] | None = None) -> list["MeshView"]:
        """The plugins' mesh views for ``config``, resolved against ``axes`` (default: its own)."""

    def facts(self, config: "ParallelConfig") -> "LayoutFacts":
        """The degrees and the facts the families decided for ``config``."""

    def resolve(self, config: "ParallelConfig", world_size: int, check: bool = True) -> "ParallelConfig":
        """``config`` with its ``-1`` degree filled in for ``world_size``, checked."""


class ParallelConfig:
    """Degrees of every parallel dimension plus the options that go with them, as declared by the plugins.

    The product of the mesh axes' degrees is the world size; ``dp_shard=-1`` takes whatever is left. A config is
    made under one registry (``registry.config(**values)``) and keeps it through ``replace``: code given a config
    reaches the plugins' declarations through ``config.registry``. ``ParallelConfig(**values)`` is made under
    ``ParallelConfig.default_registry()``, the process-wide one, set by ``core.registry`` (the front-end edge:
    the interface holds no plugin manager).
    """

    __slots__ = ("_values", "_registry", "_hash")

    #: the process-wide registry's maker, for configs made without one (set by ``core.registry``)
    default_registry: Callable[[], LayoutRegistry] | None = None

    def __init__(self, _registry: LayoutRegistry | None = None, /, **values: Any) -> None:
        if _registry is None:
            _registry = ParallelConfig.default_registry()
        object.__setattr__(self, "_registry", _registry)
        fields = _registry.fields
        for key in values:
            if key not in fields:
                raise _unknown(key, values[key], fields)
        checked = {}
        for field in fields:
            checked[field.name] = field.validate(values[field.name]) if field.name in values else (
                list(field.default) if isinstance(field.default, list) else field.default)
        object.__setattr__(self, "_values", checked)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except (KeyError, AttributeError):
            raise AttributeError(f"ParallelConfig has no field '{name}'") from None

    def __setattr__(self, name, value):
        raise AttributeError("ParallelConfig is immutable. Fix: use config.replace(field=value)")

    def __getstate__(self):
        return dict(self._values)

    def __setstate__(self, state):  # unpickled (a worker's copy): under that process's default registry
        object.__setattr__(self, "_values", dict(state))
        object.__setattr__(self, "_registry", None)

    @property
    def registry(self) -> LayoutRegistry:
        """The registry this config was made under."""
        if self._registry is None:
            object.__setattr__(self, "_registry", ParallelConfig.default_registry())
        return self._registry

    def under(self, registry: LayoutRegistry) -> "ParallelConfig":
        """This layout made under ``registry`` (itself when it already is)."""
        return self if self._registry is registry else ParallelConfig(registry, **self._values)

    def __eq__(self, other) -> bool:
        return isinstance(other, ParallelConfig) and self._values == other._values

    def __hash__(self):
        try:
            return self._hash
        except AttributeError:  # computed once: a config is immutable
            object.__setattr__(self, "_hash", hash(tuple(sorted((k, str(v)) for k, v in self._values.items()))))
            return self._hash

    def __repr__(self) -> str:
        return "ParallelConfig(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        """The default registry's layout fields."""
        return [f.name for f in ParallelConfig.default_registry().fields]

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ParallelConfig":
        return cls(**dict(data or {}))

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ParallelConfig":
        data = load_yaml(path)
        if "parallel" in data and isinstance(data["parallel"], dict):
            data = data["parallel"]
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self._values.items()}

    def replace(self, **changes: Any) -> "ParallelConfig":
        return ParallelConfig(self.registry, **{**self._values, **changes})

    # ---- the world ------------------------------------------------------------------------------------
    def resolve(self, world_size: int) -> "ParallelConfig":
        """A copy with the degree of ``-1`` filled in, after checking the mesh axes multiply to world_size."""
        return self.registry.resolve(self, world_size)

    @property
    def dp(self) -> int:
        """The data-parallel degree: product of the axes the batch rows are split over (after resolve())."""
        from .parallel_dims import ParallelDims

        return ParallelDims(self).dp


def _unknown(key: str, value: Any, fields) -> ConfigError:
    return ConfigError(f"unknown parallel key '{key}' ({key}={value!r}): no installed plugin declares it. Fix: "
                       f"{suggest(key, [f.name for f in fields])} (`ultrascale plugins` lists the fields)")


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe '{path}' does not exist. Fix: pass the path of a YAML file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe '{path}' is not valid YAML ({str(exc).splitlines()[0]}). Fix: correct the file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe '{path}' must be a mapping of keys, got {type(data).__name__}")
    return data

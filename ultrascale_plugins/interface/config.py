"""ParallelConfig: the one layout description shared by every front end.

Its fields are whatever the installed dimension plugins declare through ``ultrascale_add_fields`` (see
``fields.py``): the built-ins declare ``dp_replicate``, ``dp_shard``, ``zero_stage``, ``mixed_precision`` (data
parallel), ``tp``, ``sequence_parallel``, ``loss_parallel`` (tensor parallel), ``pp`` and its schedule fields
(pipeline), ``activation_checkpointing``, ``cp`` and ``cp_method`` (context parallel); a third-party plugin's fields join them. Values are checked when the
config is made, so a bad layout fails in milliseconds, before any process group, with an error that names the
field, the value and the fix.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .fields import ConfigError, field_error, suggest  # noqa: F401 - re-exported: every module's error type

def _fields():
    from .plugins import layout_fields

    return layout_fields()


class ParallelConfig:
    """Degrees of every parallel dimension plus the options that go with them, as declared by the plugins.

    The product of the mesh axes' degrees is the world size; ``dp_shard=-1`` takes whatever is left.
    """

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        fields = _fields()
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

    def __setstate__(self, state):
        object.__setattr__(self, "_values", dict(state))

    def __eq__(self, other) -> bool:
        return isinstance(other, ParallelConfig) and self._values == other._values

    def __hash__(self):
        return hash(tuple(sorted((k, str(v)) for k, v in self._values.items())))

    def __repr__(self) -> str:
        return "ParallelConfig(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in _fields()]

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
        return ParallelConfig(**{**self._values, **changes})

    # ---- the world ------------------------------------------------------------------------------------
    def resolve(self, world_size: int) -> "ParallelConfig":
        """A copy with the degree of ``-1`` filled in, after checking the mesh axes multiply to world_size."""
        from .parallel_dims import resolve

        return resolve(self, world_size)

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

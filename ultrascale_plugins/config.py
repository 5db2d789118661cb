"""ParallelConfig: the one layout description shared by every front end, and its validation.

Everything here is pure Python: validation runs before any process group exists, so a bad layout fails in
milliseconds with an error that names the field, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
CP_METHODS = ("ring", "ulysses")
AC_MODES = ("none", "full", "selective")
PRECISIONS = ("no", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)


class ConfigError(ValueError):
    """A layout or recipe that cannot run. The message names the field, the value and the fix."""


def field_error(field: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{field}={value!r}: {problem}. Fix: {fix}")


def suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(choices))}"


@dataclasses.dataclass
class ParallelConfig:
    """Degrees of every parallel dimension plus the per-layer options that go with them.

    The product dp_replicate * dp_shard * tp * cp * pp is the world size; dp_shard=-1 takes whatever is left.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_method: str = "ring"
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0 = as many as pipeline stages
    pp_virtual_stages: int = 1
    pp_split: list | None = None  # layers per pipeline stage, e.g. [3, 5]; None = balanced automatically
    zero_stage: int = 3
    activation_checkpointing: str = "none"
    mixed_precision: str = "no"
    loss_parallel: bool = False  # vocab-parallel cross entropy when tp > 1

    # ---- construction -------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self._check_types()
        self._check_values()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ParallelConfig":
        data = dict(data or {})
        names = cls.field_names()
        for key in data:
            if key not in names:
                raise ConfigError(f"unknown parallel key '{key}': {suggest(key, names)}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ParallelConfig":
        data = load_yaml(path)
        if "parallel" in data and isinstance(data["parallel"], dict):
            data = data["parallel"]
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "ParallelConfig":
        return ParallelConfig.from_dict({**self.to_dict(), **changes})

    # ---- checks that need nothing but the fields ------------------------------------------------
    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "pp_split":
                if value is not None and (not isinstance(value, (list, tuple)) or not all(
                        isinstance(v, int) and not isinstance(v, bool) for v in value)):
                    raise field_error(f.name, value, "must be a list of layer counts per stage",
                                      "write e.g. pp_split: [3, 5], or leave it out")
                if value is not None:
                    self.pp_split = list(value)
                continue
            want = bool if f.type in ("bool", bool) else int if f.type in ("int", int) else str
            if want is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise field_error(f.name, value, "must be an integer", f"write a number, e.g. {f.name}: 2")
            if want is bool and not isinstance(value, bool):
                raise field_error(f.name, value, "must be true or false", f"write {f.name}: true")
            if want is str and not isinstance(value, str):
                raise field_error(f.name, value, "must be a string", f"write {f.name}: {f.default}")

    def _check_values(self) -> None:
        for name in ("dp_replicate", "tp", "cp", "pp", "pp_virtual_stages"):
            if getattr(self, name) < 1:
                raise field_error(name, getattr(self, name), "must be a positive degree", f"use {name}: 1 or more")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise field_error("dp_shard", self.dp_shard, "must be positive, or -1 for the rest of the world",
                              "use dp_shard: -1")
        if self.pp_microbatches < 0:
            raise field_error("pp_microbatches", self.pp_microbatches, "must be 0 (auto) or positive",
                              "use pp_microbatches: 0")
        choices = {"pp_schedule": PP_SCHEDULES, "cp_method": CP_METHODS,
                   "activation_checkpointing": AC_MODES, "mixed_precision": PRECISIONS}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                close = difflib.get_close_matches(value, allowed, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise field_error(name, value, f"unknown value; one of {', '.join(allowed)}", f"{hint}pick one of those")
        if self.zero_stage not in ZERO_STAGES:
            raise field_error("zero_stage", self.zero_stage, "must be 0, 1, 2 or 3", "use zero_stage: 3")
        if self.sequence_parallel and self.tp == 1:
            raise field_error("sequence_parallel", True, "needs tensor parallel (tp > 1) to shard the sequence over",
                              "set tp: 2 or more, or sequence_parallel: false")
        if self.loss_parallel and self.tp == 1:
            raise field_error("loss_parallel", True, "needs tp > 1 (the vocabulary is sharded over tp)",
                              "set tp: 2 or more, or loss_parallel: false")

    # ---- checks against the world and the model ------------------------------------------------
    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with dp_shard filled in, after checking the degrees multiply to world_size."""
        fixed = self.dp_replicate * self.tp * self.cp * self.pp
        if self.dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"dp_replicate*tp*cp*pp = {self.dp_replicate}*{self.tp}*{self.cp}*{self.pp} = {fixed} does not "
                    f"divide the world size {world_size}. Fix: pick degrees whose product divides {world_size}")
            return dataclasses.replace(self, dp_shard=world_size // fixed)
        total = fixed * self.dp_shard
        if total != world_size:
            raise ConfigError(
                f"dp_replicate*dp_shard*tp*cp*pp = {self.dp_replicate}*{self.dp_shard}*{self.tp}*{self.cp}*{self.pp} "
                f"= {total} but the world size is {world_size}. Fix: make the product {world_size}, or set "
                f"dp_shard: -1 to use the rest")
        return self

    @property
    def dp(self) -> int:
        """Total data-parallel degree (replicate x shard); only meaningful after resolve()."""
        return self.dp_replicate * max(self.dp_shard, 1)

    def validate_for_model(self, model_config: Any) -> None:
        """Checks that need the Hugging Face config (heads, layers, vocabulary)."""
        heads = getattr(model_config, "num_attention_heads", None)
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        layers = getattr(model_config, "num_hidden_layers", None)
        if heads and heads % self.tp:
            raise field_error("tp", self.tp, f"does not divide num_attention_heads={heads}",
                              f"use a tp that divides {heads}")
        if kv_heads and kv_heads % self.tp:
            raise field_error("tp", self.tp, f"does not divide num_key_value_heads={kv_heads} (key/value heads are "
                              "sharded, not replicated)", f"use a tp that divides {kv_heads}")
        if layers and self.pp > layers:
            raise field_error("pp", self.pp, f"is larger than num_hidden_layers={layers}",
                              f"use pp <= {layers}")
        vocab = getattr(model_config, "vocab_size", None)
        if self.loss_parallel and vocab and vocab % self.tp:
            raise field_error("loss_parallel", True, f"needs vocab_size={vocab} divisible by tp={self.tp}",
                              "turn loss_parallel off or pad the vocabulary")


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

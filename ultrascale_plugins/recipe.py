"""A training recipe: model config, data, training loop settings and the parallel layout, from YAML plus
``--set key=value`` overrides. Validated entirely before any worker starts."""
from __future__ import annotations

import copy
import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigError, ParallelConfig, load_yaml, suggest

SECTIONS = {"nproc", "model", "data", "train", "parallel"}


@dataclasses.dataclass
class DataSpec:
    corpus: str = "builtin"
    seq_len: int = 128


@dataclasses.dataclass
class TrainSpec:
    steps: int = 60
    global_batch: int = 16
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 5
    eval_batches: int = 2
    save_dir: str = ""  # sharded checkpoints go here (step-XXXXXXXX); empty = no checkpoints
    save_every: int = 0  # steps between checkpoints (0 = only at the end, when save_dir is set)
    keep_last_n: int = 0  # 0 = keep all


@dataclasses.dataclass
class Recipe:
    nproc: int
    model: dict[str, Any]
    data: DataSpec
    train: TrainSpec
    parallel: ParallelConfig

    def to_dict(self) -> dict[str, Any]:
        return {"nproc": self.nproc, "model": dict(self.model), "data": dataclasses.asdict(self.data),
                "train": dataclasses.asdict(self.train), "parallel": self.parallel.to_dict()}

    def model_config(self):
        from transformers import AutoConfig

        spec = dict(self.model)
        model_type = spec.pop("model_type", None)
        if not model_type:
            raise ConfigError("model.model_type is missing. Fix: add e.g. model_type: llama to the model section")
        try:
            return AutoConfig.for_model(model_type, **spec)
        except ValueError as exc:
            raise ConfigError(f"model.model_type={model_type!r}: {exc}. Fix: use a transformers model type such "
                              "as llama, qwen2, mistral or gpt2") from None


def _typed(section: str, cls, data: dict[str, Any]):
    names = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in (data or {}).items():
        if key not in names:
            raise ConfigError(f"unknown key '{section}.{key}': {suggest(key, names)}")
        default = names[key].default
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{section}.{key}={value!r}: must be a number. Fix: e.g. {key}: {default}")
            if isinstance(default, int) and not isinstance(value, int):
                raise ConfigError(f"{section}.{key}={value!r}: must be an integer. Fix: e.g. {key}: {default}")
            if value < 0 or (value == 0 and key in ("steps", "global_batch", "seq_len", "log_every")):
                raise ConfigError(f"{section}.{key}={value!r}: must be positive. Fix: e.g. {key}: {default}")
        out[key] = value
    return cls(**out)


def default_recipe_dict() -> dict[str, Any]:
    text = resources.files("ultrascale_plugins").joinpath("data/default.yaml").read_text()
    return yaml.safe_load(text)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key=value`` (a parallel field, e.g. ``tp=2``) or ``section.key=value`` (e.g. ``train.steps=20``);
    values are parsed as YAML scalars."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value. Fix: e.g. --set tp=2 or --set train.steps=20")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        if "." in key:
            section, field = key.split(".", 1)
        elif key in SECTIONS:
            section, field = key, None
        else:
            section, field = "parallel", key
        if section not in SECTIONS:
            raise ConfigError(f"--set {key}: unknown section '{section}': {suggest(section, SECTIONS)}")
        if field is None:
            data[section] = value
        else:
            data.setdefault(section, {})
            data[section][field] = value
    return data


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    data = default_recipe_dict() if path is None else load_yaml(path)
    data = apply_overrides(data, overrides or [])
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(f"unknown recipe key '{key}': {suggest(key, SECTIONS)}")
    nproc = data.get("nproc", 1)
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc={nproc!r}: must be a positive integer. Fix: e.g. nproc: 4")
    model = data.get("model")
    if not isinstance(model, dict):
        raise ConfigError("the recipe has no model section. Fix: add model: {model_type: llama, ...}")
    recipe = Recipe(nproc=nproc, model=model, data=_typed("data", DataSpec, data.get("data")),
                    train=_typed("train", TrainSpec, data.get("train")),
                    parallel=ParallelConfig.from_dict(data.get("parallel")))
    return recipe

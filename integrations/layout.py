"""Where a front end's layout comes from: a ``ParallelConfig`` / dict / YAML path given in code, ``$ULTRASCALE_CONFIG``,
or Accelerate's own configuration.

Accelerate's YAML (what ``accelerate config`` writes and ``accelerate launch --config_file`` reads) has keys for
``mixed_precision``, ``num_processes``, ``fsdp_config`` and ``parallelism_config`` sizes (dp_replicate, dp_shard,
tp, cp); its launcher exports them to the workers as ``ACCELERATE_MIXED_PRECISION``, ``FSDP_*`` and
``PARALLELISM_CONFIG_*`` and they mean here what they mean in Accelerate. It has no key for the rest (pipeline,
schedule, micro-batches, sequence parallel, ZeRO stage, activation checkpointing): those live in an
``ultrascale:`` block inside ``parallelism_config`` — Accelerate accepts unknown keys inside its sections but
never exports them — and reach the workers because ``$ULTRASCALE_CONFIG`` names the file (shell variables do
reach the workers; ``ultrascale accelerate-launch`` sets it). ``ultrascale accelerate-config`` writes such a file.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..config import ConfigError, ParallelConfig
from ..parallel_dims import declared_axes

ACCELERATE_ENV_PREFIXES = ("PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_FSDP",
                           "FSDP_", "ACCELERATE_MIXED_PRECISION")
SIZE_KEYS = {"dp_replicate": "parallelism_config_dp_replicate_size", "dp_shard": "parallelism_config_dp_shard_size",
             "tp": "parallelism_config_tp_size", "cp": "parallelism_config_cp_size"}
SECTION = "ultrascale"


def make_config(config: ParallelConfig | dict | str | Path | None, fields: dict) -> ParallelConfig:
    """A ``ParallelConfig`` from an instance, a dict or a YAML path, with keyword fields on top."""
    if isinstance(config, (str, Path)):
        config = read_layout_file(config)
    elif isinstance(config, dict) or config is None:
        config = ParallelConfig.from_dict(config or {})
    return ParallelConfig.from_dict({**config.to_dict(), **fields}) if fields else config


def is_accelerate_file(data: Mapping) -> bool:
    return any(k in data for k in ("distributed_type", "compute_environment", "parallelism_config", "num_processes"))


def read_layout_file(path: str | Path) -> ParallelConfig:
    """A plain ``ParallelConfig`` YAML, or an Accelerate config file carrying the layout."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"layout file {str(path)!r} does not exist. Fix: pass the path of a YAML file")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields. Fix: write field: value lines")
    if not is_accelerate_file(data):
        return ParallelConfig.from_dict(data)
    return from_accelerate_file(data, str(path))


def from_accelerate_file(data: Mapping, where: str) -> ParallelConfig:
    section = dict(data.get("parallelism_config") or {})
    extra = dict(section.pop(SECTION, None) or {})
    fields: dict[str, Any] = {}
    for field, key in SIZE_KEYS.items():
        if key in section:
            fields[field] = int(section[key])
    _without_unit_cp(fields)
    fields.update(_fsdp_fields({k.upper(): str(v) for k, v in (data.get("fsdp_config") or {}).items()},
                               data.get("distributed_type") == "FSDP"))
    for field in extra:
        if field in fields and fields[field] != extra[field]:
            raise ConfigError(f"{where}: {field} is {fields[field]} in Accelerate's keys but {extra[field]} in the "
                              f"'{SECTION}' block. Fix: set it in one place")
    fields.update(extra)
    if str(data.get("mixed_precision", "no")) not in ("no", "None"):
        fields.setdefault("mixed_precision", str(data["mixed_precision"]))
    _check_unavailable(section)
    return ParallelConfig.from_dict(fields)


def _fsdp_fields(env: Mapping[str, str], enabled: bool) -> dict[str, Any]:
    """Accelerate's FSDP settings, in ``FSDP_*`` (launcher) or ``fsdp_*`` (YAML) spelling, as ZeRO fields."""
    def get(name):
        return env.get(f"FSDP_{name}", env.get(f"FSDP_{name}".lower()))

    if not enabled:
        return {}
    fields: dict[str, Any] = {"zero_stage": 3}
    strategy = str(get("SHARDING_STRATEGY") or "FULL_SHARD").upper()
    reshard = get("RESHARD_AFTER_FORWARD")
    if strategy in ("2", "SHARD_GRAD_OP") or (reshard is not None and str(reshard).lower() == "false"):
        fields["zero_stage"] = 2
    elif strategy in ("3", "NO_SHARD"):
        fields["zero_stage"] = 0
    elif strategy in ("4", "HYBRID_SHARD", "5", "_HYBRID_SHARD_ZERO2"):
        raise ConfigError(f"fsdp_sharding_strategy={strategy}: give the replicate/shard sizes instead. Fix: set "
                          "parallelism_config_dp_replicate_size and parallelism_config_dp_shard_size")
    if str(get("OFFLOAD_PARAMS") or "false").lower() == "true":
        raise ConfigError("fsdp_offload_params=true: CPU offload is not available. Fix: set it to false")
    if str(get("ACTIVATION_CHECKPOINTING") or "false").lower() == "true":
        fields["activation_checkpointing"] = "full"
    return fields


def _without_unit_cp(fields: dict) -> None:
    """Accelerate always writes a context-parallel size; 1 means none. A larger one needs a plugin that declares
    the ``cp`` field (ParallelConfig then refuses or accepts it)."""
    if fields.get("cp") == 1 and "cp" not in ParallelConfig.field_names():
        del fields["cp"]


def _check_unavailable(sizes: Mapping) -> None:
    sp = int(sizes.get("parallelism_config_sp_size", sizes.get("SP_SIZE", 1)) or 1)
    if sp > 1:
        raise ConfigError(f"parallelism_config_sp_size={sp}: Accelerate's sequence parallel (Ulysses) is context "
                          "parallelism here, which is not available yet. Fix: set it to 1")


def layout_from_environment(env: Mapping[str, str], world: int) -> ParallelConfig:
    """The layout of an ``accelerate launch``-ed (or torchrun-ed) worker: ``$ULTRASCALE_CONFIG`` if set, else
    what Accelerate's launcher exported, else ZeRO-3 over every process."""
    path = env.get("ULTRASCALE_CONFIG")
    if path:
        config = read_layout_file(path)
    else:
        fields: dict[str, Any] = {}
        if str(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")).lower() == "true":
            for field in SIZE_KEYS:
                value = env.get(f"PARALLELISM_CONFIG_{field.upper()}_SIZE")
                if value is not None:
                    fields[field] = int(value)
            _without_unit_cp(fields)
            _check_unavailable({k.removeprefix("PARALLELISM_CONFIG_"): v for k, v in env.items()
                                if k.startswith("PARALLELISM_CONFIG_")})
        fields.update(_fsdp_fields(env, str(env.get("ACCELERATE_USE_FSDP", "false")).lower() == "true"))
        config = ParallelConfig.from_dict(fields)
    mixed = str(env.get("ACCELERATE_MIXED_PRECISION", "no"))
    if mixed not in ("no", "None", ""):
        config = config.replace(mixed_precision=mixed)  # the data-parallel plugin checks the value
    axes = declared_axes(config)
    product = math.prod(a.degree for a in axes)
    if all(a.degree != -1 for a in axes) and product != world:
        hint = (" One process was launched: give `accelerate launch --cpu` the process count "
                "(`--num_processes N`), or a file with num_processes (as `ultrascale accelerate-config` writes it)."
                if world == 1 else "")
        missing = "" if path else (" The pipeline degree and other ultrascale fields travel in the file's "
                                   f"'{SECTION}' block: set ULTRASCALE_CONFIG=FILE (or use `ultrascale "
                                   "accelerate-launch`).")
        raise ConfigError(f"the layout asks for {'*'.join(a.name for a in axes)} = {product} processes but "
                          f"{world} were launched.{missing}{hint} Fix: make num_processes equal the product")
    return config


def accelerate_yaml(config: ParallelConfig, num_processes: int, use_cpu: bool, num_machines: int = 1) -> dict:
    """An Accelerate config file holding the whole layout."""
    sizes = {key: getattr(config, field, 1) for field, key in SIZE_KEYS.items()}
    sizes["parallelism_config_dp_shard_size"] = config.resolve(num_processes).dp_shard
    defaults = ParallelConfig().to_dict()
    extra = {k: v for k, v in config.to_dict().items()
             if k not in SIZE_KEYS and k != "mixed_precision" and v != defaults[k]}
    if extra:
        sizes[SECTION] = extra
    return {"compute_environment": "LOCAL_MACHINE",
            # MULTI_GPU is the launcher that starts num_processes workers (torchrun); with use_cpu they run on
            # CPU with gloo (`--cpu` alone would start one process, see cpu_relaunch.py).
            "distributed_type": "MULTI_GPU" if num_processes > 1 else "NO",
            "use_cpu": bool(use_cpu), "num_processes": num_processes, "num_machines": num_machines,
            "machine_rank": 0, "gpu_ids": "all", "main_training_function": "main", "rdzv_backend": "static",
            "same_network": True, "mixed_precision": "bf16" if config.mixed_precision == "bf16" else "no",
            "downcast_bf16": "no", "enable_cpu_affinity": False, "tpu_env": [], "tpu_use_cluster": False,
            "tpu_use_sudo": False, "parallelism_config": sizes}

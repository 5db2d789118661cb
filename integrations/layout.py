"""Where a front end's layout comes from: a ``ParallelConfig`` / dict / YAML path given in code, ``$ULTRASCALE_CONFIG``,
or Accelerate's own configuration.

Accelerate's YAML (what ``accelerate config`` writes and ``accelerate launch --config_file`` reads) has keys for
``mixed_precision``, ``num_processes``, ``fsdp_config`` and ``parallelism_config`` sizes (dp_replicate, dp_shard,
tp, cp, sp: each read by the dimension plugin that declares it through ``ultrascale_declare_accelerate_keys``, so
``cp_size`` is ring context parallel and ``sp_size`` Ulysses); its launcher exports them to the workers as ``ACCELERATE_MIXED_PRECISION``, ``FSDP_*`` and
``PARALLELISM_CONFIG_*`` and they mean here what they mean in Accelerate. It has no key for the rest (pipeline,
schedule, micro-batches, sequence parallel, ZeRO stage, activation checkpointing): those live in an
``ultrascale:`` block inside ``parallelism_config`` — Accelerate accepts unknown keys inside its sections but
never exports them — and reach the workers because ``$ULTRASCALE_CONFIG`` names the file (shell variables do
reach the workers; ``ultrascale accelerate-launch`` sets it). ``ultrascale accelerate-config`` writes such a file.
A plugin's own size key (expert parallel's ``parallelism_config_ep_size``) is read from the file the same way, or
from ``PARALLELISM_CONFIG_EP_SIZE`` in the environment: Accelerate's launcher does not export it. Any other key of
``parallelism_config`` that neither Accelerate nor a plugin reads (a misspelled size), and any field of the
``ultrascale`` block no plugin declares, is refused naming the file and the nearest key (``refuse_unread_keys``). A worker that
plain ``accelerate launch`` started without ``$ULTRASCALE_CONFIG`` reads the launcher's file and refuses to run
when it holds what did not reach it (``dropped_by_the_launcher``), rather than run without it.
"""
from __future__ import annotations

import difflib
import functools
import math
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..interface.config import ConfigError, ParallelConfig, suggest

ACCELERATE_ENV_PREFIXES = ("PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_FSDP",
                           "FSDP_", "ACCELERATE_MIXED_PRECISION")
YAML_PREFIX, ENV_PREFIX = "parallelism_config_", "PARALLELISM_CONFIG_"
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
        try:
            return ParallelConfig.from_dict(data)
        except ConfigError as exc:  # an unknown field or a bad value: say which file holds it
            raise ConfigError(f"{path}: {exc}") from None
    return from_accelerate_file(data, str(path))


def from_accelerate_file(data: Mapping, where: str) -> ParallelConfig:
    section = dict(data.get("parallelism_config") or {})
    extra = dict(section.pop(SECTION, None) or {})
    refuse_unread_keys(section, f"{where}: parallelism_config", YAML_PREFIX)
    refuse_unknown_fields(extra, f"{where}: parallelism_config: {SECTION}")
    fields = sizes_to_fields({k.removeprefix(YAML_PREFIX): v for k, v in section.items()
                              if k.startswith(YAML_PREFIX) and k.endswith("_size")}, where)
    fields.update(_fsdp_fields({k.upper(): str(v) for k, v in (data.get("fsdp_config") or {}).items()},
                               data.get("distributed_type") == "FSDP"))
    for field in extra:
        if field in fields and fields[field] != extra[field]:
            raise ConfigError(f"{where}: {field} is {fields[field]} in Accelerate's keys but {extra[field]} in the "
                              f"'{SECTION}' block. Fix: set it in one place")
    fields.update(extra)
    if str(data.get("mixed_precision", "no")) not in ("no", "None"):
        fields.setdefault("mixed_precision", str(data["mixed_precision"]))
    try:
        return ParallelConfig.from_dict(fields)
    except ConfigError as exc:  # a value the field refuses: say which file holds it
        raise ConfigError(f"{where}: {exc}") from None


@functools.lru_cache(maxsize=1)
def accelerates_own_keys() -> frozenset[str]:
    """The ``parallelism_config`` keys the installed Accelerate reads, without their prefix: its launcher's
    ``--parallelism_config_*`` options (the sizes, and settings such as ``cp_backend``, ``cp_comm_strategy`` and
    the ``sp_*`` ones, which have no meaning here but belong in its file). Read from Accelerate itself, so a
    version that adds a key is followed; none without Accelerate (the plugins' sizes still are)."""
    try:
        from accelerate.commands.launch import launch_command_parser
    except ImportError:
        return frozenset()
    return frozenset(action.dest.removeprefix(YAML_PREFIX) for action in launch_command_parser()._actions
                     if action.dest.startswith(YAML_PREFIX))


def refuse_unread_keys(section: Mapping[str, Any], where: str, prefix: str) -> None:
    """A key of Accelerate's ``parallelism_config`` (``prefix``: the file's ``parallelism_config_``, or the
    environment's ``PARALLELISM_CONFIG_``) that neither Accelerate nor an installed plugin reads is refused, naming
    the nearest key that is read: left out, a misspelled size (``tp_sise``, ``tp``, a bare ``tp_size``) would train
    another layout without a word. A prefixed key ending in ``_size`` is left to ``sizes_to_fields``, which refuses
    it above 1 (a plugin not installed may be what reads it)."""
    known = known_keys(prefix)
    for key, value in section.items():
        if key in known or key == SECTION or (key.startswith(prefix) and key.lower().endswith("_size")):
            continue  # the 'ultrascale' block has its own check (refuse_unknown_fields)
        raise ConfigError(f"{where}: {key}={value}: neither Accelerate nor an installed plugin reads this key, so "
                          f"it would change nothing. Fix: {nearest_key(key.removeprefix(prefix), value, prefix)}")


def known_keys(prefix: str) -> list[str]:
    """Every ``parallelism_config`` key read here, spelled with ``prefix`` (the file's or the environment's)."""
    spell = str.upper if prefix.isupper() else str.lower
    return sorted(prefix + spell(key) for key in accelerates_own_keys() | set(accelerate_keys()))


def nearest_key(bare: str, value: Any, prefix: str) -> str:
    """What a key nobody reads (``bare``: without its prefix) was likely meant to be: the size key of the layout
    field it names (``tp`` -> ``tp_size``), the ``ultrascale`` block for a field Accelerate has no key for
    (``pp_size``), else the closest key by spelling (close enough that the shared prefix alone does not count)."""
    spell = str.upper if prefix.isupper() else str.lower
    field = bare.lower().removesuffix("_size")
    if field in ParallelConfig.field_names():
        own = [key for key, (named, implied) in accelerate_keys().items() if named == field and not implied]
        if own:
            return f"did you mean '{prefix}{spell(own[0])}'?"
        return f"set {field}: {value} in parallelism_config's '{SECTION}' block (Accelerate has no key for it)"
    known = known_keys(prefix)
    close = difflib.get_close_matches(prefix + spell(bare), known, n=1, cutoff=0.85)
    return f"did you mean '{close[0]}'?" if close else f"remove it (the keys read: {', '.join(known)})"


def refuse_unknown_fields(block: Mapping[str, Any], where: str) -> None:
    """A key of the ``ultrascale`` block that no installed plugin declares, refused naming the file and the
    nearest field."""
    names = ParallelConfig.field_names()
    for field, value in block.items():
        if field not in names:
            raise ConfigError(f"{where}: {field}={value!r}: no installed plugin declares this field. Fix: "
                              f"{suggest(field, names)} (`ultrascale plugins` lists the fields)")


def accelerate_keys() -> dict[str, tuple[str, dict]]:
    """Accelerate's size keys the installed dimension plugins read (``ultrascale_declare_accelerate_keys``):
    ``{"tp_size": ("tp", {}), ...}``."""
    from ..core.registry import default_registry

    keys: dict[str, tuple[str, dict]] = {}
    for result in default_registry().hook.ultrascale_declare_accelerate_keys():
        keys.update(result or {})
    return keys


def sizes_to_fields(sizes: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Layout fields from Accelerate's sizes (``{"tp_size": 2, ...}``). A size of 1 is what Accelerate writes when
    it means none; several keys may feed one field (``cp_size`` and ``sp_size``) but only one may be above 1; a
    size above 1 that no installed plugin reads is refused."""
    keys = accelerate_keys()
    fields: dict[str, Any] = {}
    set_by: dict[str, str] = {}
    values = {key: int(raw or 1) for key, raw in sizes.items()}
    for key, value in sorted(values.items(), key=lambda item: -item[1]):  # sizes above 1 first
        if key not in keys:
            if value > 1:
                # a key Accelerate does not know either may be a misspelling of one that is read
                fix = "set it to 1, or install the plugin that provides it"
                meant = "" if key in accelerates_own_keys() else nearest_key(key, value, YAML_PREFIX)
                if meant.startswith("did you mean"):
                    fix = f"{meant} Else {fix}"
                elif meant.startswith("set "):  # a layout field Accelerate has no size for (pp_size)
                    fix = meant
                raise ConfigError(f"{where}: parallelism_config_{key}={value}: no installed plugin reads this "
                                  f"Accelerate size. Fix: {fix}")
            continue
        field, implied = keys[key]
        if value == 1 and field in set_by:
            continue  # another key sets this field
        if field in set_by:
            raise ConfigError(f"{where}: parallelism_config_{set_by[field]}={fields[field]} and "
                              f"parallelism_config_{key}={value} both set {field}. Fix: set one of them to 1")
        fields[field], set_by[field] = value, key
        if value > 1:
            fields.update(implied)
    return fields


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
        fields["cpu_offload"] = True  # FSDP2's CPUOffloadPolicy, as Accelerate's own FSDP2 path uses it
    if str(get("ACTIVATION_CHECKPOINTING") or "false").lower() == "true":
        fields["activation_checkpointing"] = "full"
    return fields


def layout_from_environment(env: Mapping[str, str], world: int) -> ParallelConfig:
    """The layout of an ``accelerate launch``-ed (or torchrun-ed) worker: ``$ULTRASCALE_CONFIG`` if set, else
    what Accelerate's launcher exported, else ZeRO-3 over every process. A layout whose degrees do not multiply to
    the processes launched is refused naming what set them; a launcher file whose ``ultrascale`` block or plugin
    sizes did not reach the workers is refused naming those (the usual cause of such a mismatch)."""
    path = env.get("ULTRASCALE_CONFIG")
    exported = not path and str(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")).lower() == "true"
    if path:
        config = read_layout_file(path)
    else:
        fields: dict[str, Any] = {}
        if exported:
            refuse_unread_keys({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)},
                               "accelerate launch's environment", ENV_PREFIX)
            fields = sizes_to_fields(exported_sizes(env), "accelerate launch")
        fields.update(_fsdp_fields(env, str(env.get("ACCELERATE_USE_FSDP", "false")).lower() == "true"))
        config = ParallelConfig.from_dict(fields)
    mixed = str(env.get("ACCELERATE_MIXED_PRECISION", "no"))
    if mixed not in ("no", "None", ""):
        config = config.replace(mixed_precision=mixed)  # the data-parallel plugin checks the value
    axes = config.registry.axes(config)
    product = math.prod(a.degree for a in axes)
    mismatch = (f"asks for {'*'.join(a.name for a in axes)} = {'*'.join(str(a.degree) for a in axes)} = {product} "
                f"processes but {world} {'was' if world == 1 else 'were'} launched") if all(a.degree != -1 for a in axes) and product != world \
        else ""
    file = launcher_config_file() if exported else None
    if file:  # Accelerate's launcher passes over a key it does not know: the launcher's file is checked here
        refuse_unread_keys(launcher_section(file), f"{file}: parallelism_config", YAML_PREFIX)
    dropped = dropped_by_the_launcher(file, env) if file else []
    if dropped:
        seen = (f", so the layout the workers see {mismatch}" if mismatch
                else ", so this run would silently leave them out")
        raise ConfigError(f"{file}: {' and '.join(dropped)} did not reach the workers (Accelerate's launcher "
                          f"exports its own sizes only){seen}. Fix: launch with `ultrascale accelerate-launch "
                          f"{file} SCRIPT`, or set ULTRASCALE_CONFIG={file}")
    if mismatch:
        if path:
            named = f"{path}: " + ", ".join(f"{a.name}={a.degree}" for a in axes if a.degree > 1)
        else:
            named = ", ".join(f"{YAML_PREFIX}{key}={value}" for key, value in sorted(exported_sizes(env).items())
                              if int(value or 1) > 1) or "the layout"
        hint = (" One process was launched: give `accelerate launch --cpu` the process count "
                "(`--num_processes N`), or a file with num_processes (as `ultrascale accelerate-config` writes it)."
                if world == 1 else "")
        unknown = (f" (an '{SECTION}' block in the launcher's file reaches the workers only through "
                   "ULTRASCALE_CONFIG=FILE)" if exported and file is None else "")
        raise ConfigError(f"{named}: the layout {mismatch}{unknown}.{hint} Fix: make num_processes {product}, or "
                          f"the sizes' product {world}")
    return config


def exported_sizes(env: Mapping[str, str]) -> dict[str, str]:
    """The ``parallelism_config`` sizes Accelerate's launcher exported (``PARALLELISM_CONFIG_TP_SIZE`` ->
    ``tp_size``)."""
    return {k.removeprefix(ENV_PREFIX).lower(): v for k, v in env.items()
            if k.startswith(ENV_PREFIX) and k.endswith("_SIZE")}


def launcher_config_file(parent_cmdline: list[str] | None = None) -> str | None:
    """The config file of the ``accelerate launch`` that started this worker (its parent process: Accelerate's
    launcher runs torchrun's agent in its own process): its ``--config_file``, else Accelerate's default file if
    there is one. None when the parent is not ``accelerate launch`` (torchrun, SLURM, ...)."""
    import os

    from .cpu_relaunch import launch_arguments

    try:
        if parent_cmdline is None:
            import psutil  # an Accelerate dependency

            parent_cmdline = psutil.Process(os.getppid()).cmdline()
        split = launch_arguments(parent_cmdline)
        if split is None:
            return None
        from accelerate.commands.config import default_config_file
        from accelerate.commands.launch import launch_command_parser

        given = launch_command_parser().parse_args([*split[0], *split[1]]).config_file
    except Exception:  # noqa: BLE001 - no way to tell: the layout is what the launcher exported
        return None
    return given or (default_config_file if os.path.isfile(default_config_file) else None)


def launcher_section(file: str | Path) -> dict:
    """The ``parallelism_config`` section of the launcher's file ({} when it cannot be read: the layout is then
    what the launcher exported)."""
    try:
        data = yaml.safe_load(Path(file).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    section = data.get("parallelism_config") if isinstance(data, dict) else None
    return dict(section) if isinstance(section, dict) else {}


def dropped_by_the_launcher(file: str | Path, env: Mapping[str, str]) -> list[str]:
    """The keys of an Accelerate config file's ``parallelism_config`` that ``accelerate launch`` did not pass to
    its workers: a size above 1 that no ``PARALLELISM_CONFIG_*`` variable carries (Accelerate exports a fixed set,
    which a plugin's size such as ``ep_size`` is not in) and the ``ultrascale`` block."""
    dropped = []
    for key, value in launcher_section(file).items():
        if key == SECTION and value:
            dropped.append(f"the '{SECTION}' block ({', '.join(sorted(value))})")
        elif key.startswith(YAML_PREFIX) and key.endswith("_size") and str(value).isdigit() and int(value) > 1 \
                and ENV_PREFIX + key.removeprefix(YAML_PREFIX).upper() not in env:
            dropped.append(f"{key}={value}")
    return dropped


def accelerate_yaml(config: ParallelConfig, num_processes: int, use_cpu: bool, num_machines: int = 1) -> dict:
    """An Accelerate config file holding the whole layout."""
    resolved = config.resolve(num_processes)
    plain = {key: field for key, (field, implied) in accelerate_keys().items() if not implied}
    sizes = {YAML_PREFIX + key: getattr(resolved, field) for key, field in plain.items()}
    defaults = ParallelConfig().to_dict()
    extra = {k: v for k, v in config.to_dict().items()
             if k not in plain.values() and k != "mixed_precision" and v != defaults[k]}
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


def compile_from_dynamo(plugin: Any, backend: Any, env: Mapping[str, str]) -> str | None:
    """Accelerate's torch.compile settings (``dynamo_plugin=`` / ``dynamo_backend=`` in code, ``dynamo_config`` in
    its YAML, which the launcher exports as ``ACCELERATE_DYNAMO_*``; the Trainer's ``torch_compile`` arrives the
    same way) as this package's ``compile`` field: "regional" when they ask for compilation, None when not.
    Accelerate would compile the whole model; here each decoder layer is compiled once, inside the layout
    (``features/compile/plugin.py``), so the model is never compiled twice. Settings regional compilation does not take are
    refused, naming the setting."""
    name = getattr(plugin, "backend", None) if plugin is not None else backend
    name = getattr(name, "value", name) or env.get("ACCELERATE_DYNAMO_BACKEND")
    if name is None or str(name).lower() == "no":
        return None
    if str(name).lower() != "inductor":
        raise ConfigError(f"dynamo_backend={name!r}: ultrascale compiles each decoder layer with inductor only. "
                          "Fix: use dynamo_backend: inductor (or no)")
    mode = getattr(plugin, "mode", None) if plugin is not None else env.get("ACCELERATE_DYNAMO_MODE")
    if mode not in (None, "", "default"):
        raise ConfigError(f"dynamo_mode={mode!r}: regional compilation runs inductor's default mode (CUDA graphs "
                          "would capture the layouts' collectives). Fix: use dynamo_mode: default")
    return "regional"

"""A training recipe: model config, data, training loop settings and the parallel layout, from YAML plus
``--set key=value`` overrides. Validated entirely before any worker starts."""
from __future__ import annotations

import copy
import dataclasses
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..interface.config import ConfigError, ParallelConfig, load_yaml, suggest
from ..interface.recipe_section import SavedRun
from ..interface.step_schedule import StepSchedule
from .model_section import check_model_section, config_from_fields, config_keys, read_config_json, refused_value_line

OWN_SECTIONS = ("nproc", "model", "data", "train", "parallel")


def recipe_sections(pm=None) -> dict:
    """{name: ``RecipeSection``} of the sections the plugins of ``pm`` declare (``ultrascale_declare_recipe_sections``:
    PEFT's ``peft``); a name declared twice, or one of the recipe's own, is refused. Without ``pm``: the process's
    registry (a recipe read from its file, before any layout is made)."""
    from ..core.registry import given_or_default

    out: dict = {}
    for answer in given_or_default(pm).hook.ultrascale_declare_recipe_sections():
        for section in answer or ():
            if section.name in OWN_SECTIONS or section.name in out:
                raise ConfigError(f"recipe section '{section.name}' is declared twice (by {type(section).__name__}). "
                                  "Fix: uninstall one of the plugins that declare it")
            out[section.name] = section
    return out


def section_names() -> set[str]:
    """Every top-level key a recipe may have: its own sections and the plugins'."""
    return {*OWN_SECTIONS, *recipe_sections()}


@dataclasses.dataclass
class DataSpec:
    corpus: str = "builtin"  # the byte-level corpus (ids 0-255): "builtin" or a text file; used without dataset
    dataset: str = ""  # a .jsonl/.json/.parquet/.txt file, a directory of them, or a datasets.save_to_disk dir
    format: str = "text"  # text: plain documents; chat: conversations, loss on the assistant's tokens only
    text_field: str = "text"
    messages_field: str = "messages"
    tokenizer: str = ""  # a tokenizer directory; default: the --init-from directory
    seq_len: int = 128
    packing: bool = True  # concatenate samples into seq_len rows (position_ids restart at each sample)
    eval_fraction: float = 0.0  # the share of samples held out for validation (0: a dataset has no validation)
    cache_dir: str = ""  # where tokenized datasets are kept; default $ULTRASCALE_CACHE or ~/.cache/ultrascale
    num_proc: int = 0  # tokenizing processes; 0: up to 8, one per core

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ConfigError(f"data.format={self.format!r}: {suggest(str(self.format), FORMATS)}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction!r}: must be at least 0 and below 1. Fix: "
                              "e.g. eval_fraction: 0.05")
        if not self.dataset and (self.format != "text" or self.tokenizer):
            key = "format: chat" if self.format != "text" else f"tokenizer: {self.tokenizer}"
            raise ConfigError(f"data.{key} needs data.dataset (the byte-level corpus has no tokenizer or "
                              "conversations). Fix: add dataset: path/to/data.jsonl")


FORMATS = ("text", "chat")


TRAIN_OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit")


@dataclasses.dataclass
class TrainSpec:
    steps: int = 60
    epochs: int = 0  # passes over a dataset; sets steps (epochs x steps per epoch); 0: train.steps decides
    global_batch: int = 16  # sequences per optimizer step = data-parallel size x micro_batch_size x grad_accum
    micro_batch_size: int = 0  # rows per forward/backward on each data-parallel rank; 0 = derived
    grad_accum: int = 0  # micro-batches per optimizer step (with pp > 1: the pipeline's); 0 = derived
    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.0
    # adamw: torch's fused AdamW, states in the weights' dtype; adamw_8bit / adamw_4bit: torchao's low-bit states
    # (the float8 extra installs torchao)
    optimizer: str = "adamw"
    # round each bf16 weight update stochastically (torchao), so updates smaller than bf16's step are not lost on
    # average: for parallel.param_dtype: bf16
    bf16_stochastic_round: bool = False
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 5
    eval_batches: int = 2
    save_dir: str = ""  # sharded checkpoints go here (step-XXXXXXXX); empty = no checkpoints
    save_every: int = 0  # steps between checkpoints (0 = only at the end, when save_dir is set)
    keep_last_n: int = 0  # 0 = keep all
    async_save: bool = False  # write checkpoints in the background while training goes on (committed when done)
    # SIGTERM (a scheduler's scancel, `kill`): finish the step every rank is in, save a checkpoint to save_dir, then
    # stop; off: stop at once without saving. SIGINT (Ctrl-C) and SIGHUP always stop at once
    save_on_signal: bool = False
    # seconds the workers get after a stop signal before they are killed (torchrun's --shutdown-timeout, the
    # command's own bound): at least one step plus a save with save_on_signal, and within the scheduler's grace
    signal_grace_s: int = 30

    def __post_init__(self):
        if self.optimizer not in TRAIN_OPTIMIZERS:
            raise ConfigError(f"train.optimizer={self.optimizer!r}: not one of {', '.join(TRAIN_OPTIMIZERS)}. Fix: "
                              "use adamw, or adamw_8bit / adamw_4bit for torchao's low-bit states")
        if self.save_on_signal and not self.save_dir:
            raise ConfigError("train.save_on_signal=true needs train.save_dir (where the checkpoint goes). Fix: set "
                              "train.save_dir, or train.save_on_signal: false")
        if self.signal_grace_s < 1:
            raise ConfigError(f"train.signal_grace_s={self.signal_grace_s!r}: must be at least 1 second. Fix: e.g. "
                              "signal_grace_s: 30")


@dataclasses.dataclass
class Recipe:
    nproc: int
    model: dict[str, Any]
    data: DataSpec
    train: TrainSpec
    parallel: ParallelConfig
    init_from: str = ""  # a pretrained directory: its config.json is the model (a model section must agree in sizes)
    resume_from: str = ""  # a checkpoint (without init_from): the config it was saved with is the model
    # the plugins' sections the recipe sets (``recipe_sections``: PEFT's ``peft``), {name: the value it read}
    sections: dict[str, Any] = dataclasses.field(default_factory=dict)

    def section(self, name: str) -> Any:
        """The value of the plugins' section ``name`` (``peft``), None when the recipe does not set it."""
        return self.sections.get(name)

    def to_dict(self) -> dict[str, Any]:
        out = {"nproc": self.nproc, "model": dict(self.model), "data": dataclasses.asdict(self.data),
               "train": dataclasses.asdict(self.train), "parallel": self.parallel.to_dict()}
        owners = recipe_sections(self.parallel.registry)
        out.update({name: owners[name].to_dict(value) for name, value in self.sections.items()})
        return out

    def base_dtype(self) -> dict:
        """How the model is built (``from_config``'s keywords): what the sections ask (a PEFT recipe's frozen base
        in ``peft.base_dtype``); otherwise nothing (fp32, transformers' default)."""
        owners, out = recipe_sections(self.parallel.registry), {}
        for name, value in self.sections.items():
            out.update(owners[name].model_kwargs(value))
        return out

    def apply_sections(self, model):
        """``model`` (on the meta device) with every section the recipe sets applied (PEFT's adapters)."""
        owners = recipe_sections(self.parallel.registry)
        for name, value in self.sections.items():
            model = owners[name].apply(model, value)
        return model

    def describe_sections(self) -> str:
        """The sections the recipe sets, in a few words each ("" for none)."""
        owners = recipe_sections(self.parallel.registry)
        return ", ".join(owners[name].describe(value) for name, value in self.sections.items())

    def checkpoint_holds_whole_model(self) -> bool:
        """Whether this recipe's checkpoints hold every parameter (False: adapters only, the base read again from
        the run's ``--init-from``)."""
        owners = recipe_sections(self.parallel.registry)
        return all(owners[name].checkpoint_holds_whole_model(value) for name, value in self.sections.items())

    def model_config(self):
        if self.init_from:
            return pretrained_config(self.init_from)
        if self.resume_from:
            return checkpoint_config(self.resume_from)
        return model_config_of(self.model)


def checkpoint_config(path: str):
    """The transformers config a checkpoint was saved with (its ``ultrascale.json``); ``path`` is a
    step-XXXXXXXX directory or a save_dir (its newest)."""
    from ..checkpoints.sharded import read_meta, resolve_checkpoint, saved_model_config

    p = resolve_checkpoint(path)
    return saved_model_config(read_meta(p), p)


# the fields that size a model's parameters, named in a line when a recipe leaves them to transformers' defaults
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "num_local_experts", "num_experts",
               "moe_intermediate_size")


def defaulted_sizes(model: dict, config) -> dict:
    """The size fields ``config`` has that the recipe's ``model`` section does not set (under any of their
    names: an ``attribute_map`` alias and its target are one field, named once), with the values transformers'
    defaults gave them; fields derived from others (default None) are left out."""
    import inspect

    aliases = getattr(config, "attribute_map", {}) or {}
    given = {aliases.get(name, name) for name in model}  # each field the section sets, by its target name
    try:
        params = inspect.signature(type(config).__init__).parameters
    except (TypeError, ValueError):
        params = {}
    out, seen = {}, set()
    for name in SIZE_FIELDS:
        field = aliases.get(name, name)
        if field in given or field in seen or getattr(config, name, None) is None:
            continue
        seen.add(field)
        if field in params and params[field].default is None:
            continue
        out[name] = getattr(config, name)
    return out


def own_model_section(path, overrides: list[str] | None, model: dict) -> dict:
    """What the user wrote of the model section: the recipe file's, or (embedded default) the --set model.X."""
    if path is not None:
        return dict(model or {})
    return dict(apply_overrides({}, overrides or []).get("model") or {})


def compare_with_checkpoint(own: dict, config, where: str) -> list[str]:
    """Refuse (ConfigError) a model section that disagrees with the checkpoint's model ``config`` in its type or
    a field that sizes a parameter; return the other disagreements as ``"key: recipe V, checkpoint W"``."""
    return compare_model_section(own, config, where, "the checkpoint",
                                 "drop those keys from the model section (or set the checkpoint's values), or pass "
                                 "the --init-from directory the run started from")


def compare_with_pretrained(own: dict, config, where: str) -> list[str]:
    """As ``compare_with_checkpoint``, for ``--init-from``'s config.json: the pretrained weights fix the sizes, and
    its config is the model."""
    return compare_model_section(own, config, where, "config.json",
                                 "drop those keys from the model section (or set config.json's values): the "
                                 "pretrained weights have config.json's sizes")


def compare_model_section(own: dict, config, where: str, source: str, fix: str) -> list[str]:
    """Refuse (ConfigError) a model section (what the user wrote: ``own``) that disagrees with ``config`` (the
    model that is used, which ``source`` holds: "the checkpoint", "config.json") in its type or in a field that
    changes a parameter's shape; return the other disagreements as ``"key: recipe V, checkpoint W"``. Keys that agree pass silently; a legacy name (``rope_scaling``)
    is compared as the field transformers turns it into."""
    from ..interface.estimates import meta_model

    own = dict(own)
    label = source.removeprefix("the ")
    model_type = own.pop("model_type", None) or config.model_type
    if model_type != config.model_type:
        raise ConfigError(f"{where}: {source} holds a '{config.model_type}' model but the recipe's "
                          f"model.model_type is '{model_type}'. Fix: use the recipe the model was made with, or drop "
                          f"the model section ({label}'s config is the model)")
    if not own:
        return []
    mine = model_config_of({"model_type": model_type, **own})
    differ = {k: (getattr(mine, k, None), getattr(config, k, None)) for k in _fields_set(mine, own)
              if getattr(mine, k, None) != getattr(config, k, None)}
    if not differ:
        return []

    def shapes(cfg):
        return {n: tuple(p.shape) for n, p in meta_model(cfg).named_parameters()}

    theirs = shapes(config)
    sizes = []
    for key, (value, _) in differ.items():
        try:
            trial = model_config_of({**config.to_dict(), "model_type": model_type, key: value}, check=False)
            if shapes(trial) != theirs:
                sizes.append(key)
        except Exception:  # noqa: BLE001 - a value that does not even build a model is a size disagreement
            sizes.append(key)
    if sizes:
        what = ", ".join(f"model.{k}={differ[k][0]!r} ({label}: {differ[k][1]!r})" for k in sizes)
        raise ConfigError(f"{where}: the recipe's {what} does not match the model {source} holds, whose config is "
                          f"used. Fix: {fix}")
    return [f"{k}: recipe {v!r}, {label} {w!r}" for k, (v, w) in differ.items()]


def _fields_set(config, own: dict) -> list[str]:
    """The fields of ``config`` (built from the model section ``own``) that the section sets: its keys, with each
    alias as its target and each legacy name as the fields it changes (``rope_theta``: ``rope_parameters``)."""
    aliases = getattr(config, "attribute_map", {}) or {}
    known, _ = config_keys(type(config))
    out = []
    for key, value in own.items():
        if key in known:
            names = [aliases.get(key, key)]
        else:  # a legacy name: what it changes against the class's defaults
            try:
                base, alone = type(config)().to_dict(), type(config)(**{key: value}).to_dict()
                names = [k for k in alone if alone[k] != base.get(k)]
            except Exception:  # noqa: BLE001 - compared under its own name then
                names = [key]
        out += [n for n in names if n not in out]
    return out


def saved_run(path: str) -> SavedRun | None:
    """What the checkpoint ``path`` says of the run that wrote it (``ultrascale.json``'s ``extra``: the recipe and
    the ``--init-from`` directory it started from), or None for a missing or unreadable checkpoint."""
    from ..checkpoints.sharded import read_meta, resolve_checkpoint

    try:
        meta = read_meta(resolve_checkpoint(path))
    except Exception:  # noqa: BLE001 - a missing or broken checkpoint is reported where it is read
        return None
    extra = meta.get("extra") or {}
    recipe, init_from = extra.get("recipe"), extra.get("init_from")
    return SavedRun(str(path), recipe if isinstance(recipe, dict) else None,
                    init_from if isinstance(init_from, str) else "")


def recorded_init_from(path: str) -> str:
    """The ``--init-from`` directory the run that wrote the checkpoint ``path`` started from, or ""."""
    saved = saved_run(path)
    return saved.init_from if saved is not None else ""


def pretrained_config(directory: str):
    """The transformers config of a ``save_pretrained`` directory (``--init-from``); a config.json that is not
    JSON, or holds a value transformers refuses, is refused in one line naming the file and the field."""
    from transformers import AutoConfig

    where, path = f"--init-from {directory}", Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{where}: no config.json there. Fix: pass a directory written by "
                          "save_pretrained (config.json + *.safetensors)")
    fields = read_config_json(path, where)
    try:
        return AutoConfig.from_pretrained(directory)
    except Exception as exc:  # noqa: BLE001 - transformers' refusals of a value: ValueError, TypeError, strict checks
        raise ConfigError(refused_value_line(exc, fields, f"{where}: {path}")) from None


def model_config_of(model: dict, check: bool = True, where: str = "the recipe"):
    """The transformers config of a recipe's ``model`` section, after checking its keys (``check_model_section``;
    ``check=False``: a config's own ``to_dict``, which may hold the extra keys a config.json brought); a value
    transformers refuses is said in one line naming ``where`` (the recipe file) and the field."""
    if check:
        check_model_section(model)
    if not model.get("model_type"):
        raise ConfigError("model.model_type is missing. Fix: add e.g. model_type: llama to the model section")
    return config_from_fields(model, where, prefix="model.")


# the recipe's sections that are mappings of fields, with the example a refusal gives
SECTION_EXAMPLES = {"model": "{model_type: llama, hidden_size: 2048}", "data": "{seq_len: 2048}",
                    "train": "{steps: 100, global_batch: 32}", "parallel": "{tp: 2}"}


def _check_mapping(data: dict[str, Any], name: str, where: str, example: str) -> None:
    """Refuse (ConfigError naming the recipe file and the section) a section that is set but is not a mapping of
    fields (``parallel: [1, 2]``, ``train: 5``), which would otherwise fail deep inside as a TypeError or an
    AttributeError; absent or null is an empty section."""
    value = data.get(name)
    if value is None or isinstance(value, dict):
        return
    kind = type(value).__name__
    article = "an" if kind[0] in "aeiou" else "a"
    raise ConfigError(f"{where}: {name} is {article} {kind} ({value!r}). Fix: write it as a mapping of fields, e.g. "
                      f"{name}: {example}")


def _typed(section: str, cls, data: dict[str, Any]):
    names = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in (data or {}).items():
        if key not in names:
            raise ConfigError(f"unknown key '{section}.{key}': {suggest(key, names)}")
        default = names[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{section}.{key}={value!r}: must be true or false. Fix: e.g. {key}: {str(default).lower()}")
        if isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"{section}.{key}={value!r}: must be a string. Fix: quote it, e.g. {key}: \"{value}\"")
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{section}.{key}={value!r}: must be a number. Fix: e.g. {key}: {default}")
            if isinstance(default, int) and not isinstance(value, int):
                raise ConfigError(f"{section}.{key}={value!r}: must be an integer. Fix: e.g. {key}: {default}")
            if value < 0 or (value == 0 and key in ("steps", "global_batch", "seq_len", "log_every")):
                rule = "must be 0 or more" if default == 0 else "must be positive"
                raise ConfigError(f"{section}.{key}={value!r}: {rule}. Fix: e.g. {key}: {default}")
        out[key] = value
    return cls(**out)


def default_recipe_dict() -> dict[str, Any]:
    text = resources.files("ultrascale_plugins").joinpath("resources/default.yaml").read_text()
    return yaml.safe_load(text)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key=value`` (a parallel field, e.g. ``tp=2``) or ``section.key=value`` (e.g. ``train.steps=20``; deeper
    keys set a field inside a mapping, e.g. ``model.rope_parameters.factor=8``); values are parsed as YAML
    scalars."""
    data, names = copy.deepcopy(data), section_names()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value. Fix: e.g. --set tp=2 or --set train.steps=20")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        if "." in key:
            section, field = key.split(".", 1)
        elif key in names:
            section, field = key, None
        else:
            section, field = "parallel", key
        if section not in names:
            raise ConfigError(f"--set {key}: unknown section '{section}': {suggest(section, names)}")
        if field is None:
            data[section] = value
        else:  # section.a.b=value sets b inside a (a sub-config: model.text_config.hidden_size=64)
            *path, last = field.split(".")
            at, where = data, []
            for name in (section, *path):
                where.append(name)
                if at.get(name) is None:
                    at[name] = {}
                elif not isinstance(at[name], dict):
                    raise ConfigError(f"--set {key}: {'.'.join(where)} is {at[name]!r}, not a mapping of fields. "
                                      f"Fix: make it a mapping in the recipe, or set it whole: --set "
                                      f"{'.'.join(where)}=VALUE")
                at = at[name]
            at[last] = value
    return data


def resolve_batching(train: TrainSpec, parallel: ParallelConfig, world_size: int) -> tuple[TrainSpec, ParallelConfig]:
    """``train`` with ``micro_batch_size`` and ``grad_accum`` filled in, and ``parallel`` with a pipeline's
    ``pp_microbatches`` set to ``grad_accum``, after checking ``global_batch = dp x micro_batch_size x grad_accum``
    where ``dp`` is the number of row shards of the layout resolved against ``world_size``.

    Neither given: one micro-batch per step (with pp > 1: the pipeline's micro-batches, ``pp_microbatches`` or
    its default of one per stage); one given: the other is derived; both given: they must multiply out."""
    gb, mbs, ga = train.global_batch, train.micro_batch_size, train.grad_accum
    from ..interface.parallel_dims import ParallelDims

    resolved = parallel.resolve(world_size)  # a bad layout fails here, with the layout's own message
    dims = ParallelDims(resolved)
    dp = dims.dp  # the product of the mesh axes that split rows (dp_replicate x dp_shard, a plugin's own)
    pp = getattr(resolved, "pp", 1)
    row_axes = " x ".join(f"{name}={dims.degree(name)}" for name in dims.row_axes) or "no axis splits rows"
    dp_text = f"the data-parallel size {dp} ({row_axes})"
    if gb % dp:
        raise ConfigError(f"train.global_batch={gb} is not divisible by {dp_text}. Fix: use a multiple of {dp}, "
                          f"e.g. global_batch: {dp * max(1, round(gb / dp))}")
    rows = gb // dp  # each data-parallel rank's share of a step
    if mbs and ga:
        if dp * mbs * ga != gb:
            raise ConfigError(f"train.micro_batch_size={mbs} x train.grad_accum={ga} x {dp_text} = {dp * mbs * ga}, "
                              f"but train.global_batch={gb}. Fix: set global_batch: {dp * mbs * ga}, or set one of "
                              "micro_batch_size / grad_accum to 0 to derive it")
    elif mbs:
        if rows % mbs:
            raise ConfigError(f"train.micro_batch_size={mbs}: train.global_batch={gb} / {dp_text} = {rows} rows per "
                              f"rank, not a multiple of {mbs}. Fix: use a micro_batch_size that divides {rows}, or "
                              f"a global_batch that is a multiple of {dp * mbs}")
        ga = rows // mbs
    else:
        knob = "train.grad_accum"
        if ga:
            field = f"train.grad_accum={ga}"
        elif pp > 1:  # the pipeline's micro-batches, as before grad_accum existed
            ga = (resolved.registry.hook.ultrascale_cost_schedule(config=resolved) or StepSchedule()).microbatches
            if resolved.pp_microbatches:
                field, knob = f"pp_microbatches={ga}", "pp_microbatches (or train.grad_accum)"
            else:
                field = f"the pipeline's default of {ga} micro-batches (one per stage; pp_microbatches=0)"
        else:
            ga = 1
            field = "train.grad_accum=1"
        if rows % ga:
            raise ConfigError(f"{field}: train.global_batch={gb} / {dp_text} = {rows} rows per rank, which do not "
                              f"split into {ga} micro-batches. Fix: use a global_batch that is a multiple of "
                              f"{dp * ga}, or set {knob} to a divisor of {rows}")
        mbs = rows // ga
    if pp > 1:  # the micro-batches are the pipeline schedule's: one train_step runs all of them
        if parallel.pp_microbatches and parallel.pp_microbatches != ga:
            raise ConfigError(f"train.grad_accum={ga} but pp_microbatches={parallel.pp_microbatches}: with pp={pp} "
                              "the gradient-accumulation micro-batches are the pipeline's. Fix: set only one of "
                              "them (or both to the same value)")
        parallel = parallel.replace(pp_microbatches=ga)
        try:
            parallel.resolve(world_size)
        except ConfigError as exc:
            raise ConfigError(f"train.grad_accum={ga} sets the pipeline's micro-batches (pp={pp}): {exc} (or set "
                              "train.grad_accum to that value)") from None
    return dataclasses.replace(train, micro_batch_size=mbs, grad_accum=ga), parallel


def _auto_layout(parallel, train, data_spec, model_config, world: int):
    """``parallel: {layout: auto}``: the layout chosen for this recipe's model, sequence and batch, through the same
    hook every front end's layout goes through (``ultrascale_validate_choose_layout``: the planner), and its micro-batch
    size (the chosen layout's ``auto_micro_batch_size``), unless the recipe sets its split."""
    auto = parallel.replace(auto_seq_len=data_spec.seq_len, auto_global_batch=train.global_batch)
    chosen = auto.registry.hook.ultrascale_validate_choose_layout(config=auto, model_config=model_config,
                                                                  world_size=world) or auto
    mbs = getattr(chosen, "auto_micro_batch_size", 0)
    if mbs and not train.micro_batch_size and not train.grad_accum:
        train = dataclasses.replace(train, micro_batch_size=mbs)
    return chosen, train


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None,
                world_size: int | None = None, nnodes: int = 1, init_from: str | None = None,
                resume_from: str | None = None) -> Recipe:
    """The recipe at ``path`` (the embedded default when None) with ``overrides``, checked and with its derived
    values filled in. ``world_size`` (default: the recipe's ``nproc`` per node x ``nnodes``) is the number of
    processes the layout is resolved against: a worker started by torchrun or SLURM passes the real one.
    ``init_from`` (a pretrained directory) stands for the model section, which may then be left out; so does
    ``resume_from`` (a checkpoint) without ``init_from``: the model is the one the checkpoint holds, and a model
    section that disagrees with it in a size is refused."""
    data = default_recipe_dict() if path is None else load_yaml(path)
    data = apply_overrides(data, overrides or [])
    owners = recipe_sections()  # a recipe read from its file: the process's registry's sections
    for key in data:
        if key not in OWN_SECTIONS and key not in owners:
            raise ConfigError(f"unknown recipe key '{key}': {suggest(key, section_names())}")
    nproc = data.get("nproc", 1)
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc={nproc!r}: must be a positive integer. Fix: e.g. nproc: 4")
    where = str(path) if path is not None else "the default recipe"
    for name, example in (*SECTION_EXAMPLES.items(), *((n, o.example) for n, o in owners.items())):
        _check_mapping(data, name, where, example)
    model = data.get("model")
    if init_from or resume_from:
        model = model or {}
    elif model is None:
        raise ConfigError("the recipe has no model section. Fix: add model: {model_type: llama, ...}, or start "
                          "from pretrained weights with --init-from HF_DIR")
    data_spec = _typed("data", DataSpec, data.get("data"))
    train_section = data.get("train") or {}
    train = _typed("train", TrainSpec, train_section)
    if train.epochs and "steps" in train_section:
        raise ConfigError(f"train.epochs={train.epochs} and train.steps={train.steps} are both set. Fix: keep one "
                          "(epochs sets the steps from the dataset's size)")
    if train.epochs and not data_spec.dataset:
        raise ConfigError(f"train.epochs={train.epochs} needs data.dataset (the byte-level corpus is sampled, not "
                          "read in epochs). Fix: set train.steps instead, or add data.dataset")
    parallel = ParallelConfig.from_dict(data.get("parallel"))
    sections = {name: value for name, owner in owners.items() if (value := owner.read(data.get(name))) is not None}
    world = world_size or nproc * nnodes
    recipe = Recipe(nproc=nproc, model=model, data=data_spec, train=train, parallel=parallel,
                    init_from=str(init_from or ""), resume_from="" if init_from else str(resume_from or ""),
                    sections=sections)
    own = own_model_section(path, overrides, model)
    if not (init_from or resume_from):
        model_config_of(model, where=where)  # its keys, then its values as transformers checks them
    elif recipe.init_from and own:  # the pretrained weights' config.json is the model
        compare_with_pretrained(own, recipe.model_config(), f"--init-from {init_from}")
    elif recipe.resume_from:
        compare_with_checkpoint(own, recipe.model_config(), f"--resume {resume_from}")
    if resume_from:
        saved = saved_run(resume_from)
        for name, owner in owners.items() if saved is not None else ():
            owner.check_resume(sections.get(name), saved, init_from)
    if getattr(parallel, "layout", "manual") == "auto":
        parallel, train = _auto_layout(parallel, train, data_spec, recipe.model_config(), world)
    train, parallel = resolve_batching(train, parallel, world)
    return dataclasses.replace(recipe, train=train, parallel=parallel)

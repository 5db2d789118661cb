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
from ..interface.extras import install_command
from .model_section import check_model_section, config_from_fields, config_keys, read_config_json, refused_value_line

SECTIONS = {"nproc", "model", "data", "train", "parallel", "peft"}


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


PEFT_METHODS = ("lora",)


@dataclasses.dataclass
class PeftSpec:
    """The recipe's ``peft:`` section: LoRA adapters (``peft.LoraConfig``) on the model, whose base is frozen; the
    worker wraps the model with ``peft.get_peft_model`` on the meta device, before ``parallelize``. Absent: no
    PEFT, every parameter trains."""

    method: str = "lora"  # the adapter kind; DoRA is LoRA with use_dora
    r: int = 16  # the adapters' rank
    alpha: float = 32  # lora_alpha: the update is scaled by alpha / r (alpha / sqrt(r) with use_rslora)
    dropout: float = 0.0  # lora_dropout, on the adapters' input
    # the modules that get adapters: "all-linear" (every linear layer but the output head), a list of module names
    # (a name matches a module whose name is it or ends with "." + it: q_proj, mlp.down_proj), or one regular
    # expression matched against the whole module name, as PEFT reads target_modules
    target_modules: Any = "all-linear"
    modules_to_save: list = dataclasses.field(default_factory=list)  # modules trained whole (e.g. lm_head)
    use_dora: bool = False  # DoRA: a trained magnitude per output feature, from the base weight's norms
    use_rslora: bool = False  # rank-stabilized scaling: alpha / sqrt(r)
    # the frozen base's dtype: bf16 (half the bytes of weights that never train; the adapters stay fp32, as PEFT
    # keeps them), or fp32
    base_dtype: str = "bf16"
    # QLoRA: the adapted linear layers' frozen weights quantized ("nf4": torchao's 4-bit NormalFloat,
    # features/peft/quantized_base), each read whole and quantized whole as it is loaded, every rank keeping only
    # its shard; the matmuls dequantize to base_dtype. "" (the default): not quantized
    quantize_base: str = ""

    @property
    def torch_base_dtype(self):
        import torch

        return torch.bfloat16 if self.base_dtype == "bf16" else torch.float32

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_modules"] = (list(self.target_modules) if isinstance(self.target_modules, (list, tuple))
                                 else self.target_modules)
        return out

    def lora_config(self):
        """The ``peft.LoraConfig`` of this section. No ``task_type``: ``get_peft_model`` then returns the plain
        ``PeftModel``, whose forward is the causal LM's (``task_type="CAUSAL_LM"`` trains the same: its wrapper hands
        the labels on to the causal LM)."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, modules_to_save=list(self.modules_to_save) or None,
                          use_dora=self.use_dora, use_rslora=self.use_rslora)

    def describe(self) -> str:
        kind = "DoRA" if self.use_dora else "LoRA"
        targets = (self.target_modules if isinstance(self.target_modules, str)
                   else ",".join(self.target_modules))
        saved = f", training {','.join(self.modules_to_save)} whole" if self.modules_to_save else ""
        base = f", the base in {self.quantize_base.upper()}" if self.quantize_base else ""
        return (f"{'Q' if self.quantize_base else ''}{kind} r={self.r} alpha={self.alpha:g}"
                f"{' (rsLoRA)' if self.use_rslora else ''} on {targets}{saved}{base}")


def peft_spec(section: Any) -> PeftSpec | None:
    """The recipe's ``peft:`` section checked and typed (None when absent or null); every bad value is refused
    naming the field, the value and a fix, and a section without peft installed says how to install it."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"peft={section!r}: must be a section of fields. Fix: e.g. peft: {{method: lora, r: 16}} "
                          "(or --set peft.method=lora), or leave it out for full fine-tuning")
    names = {f.name for f in dataclasses.fields(PeftSpec)}
    for key in section:
        if key not in names:
            raise ConfigError(f"unknown key 'peft.{key}': {suggest(str(key), names)}")
    spec = PeftSpec(**section)
    if spec.base_dtype not in ("bf16", "fp32"):
        raise ConfigError(f"peft.base_dtype={spec.base_dtype!r}: the frozen base is held in bf16 or fp32. Fix: "
                          "base_dtype: bf16 (the default), or fp32")
    if spec.method not in PEFT_METHODS:
        raise ConfigError(f"peft.method={spec.method!r}: only lora is supported (DoRA is lora with use_dora: true). "
                          "Fix: method: lora")
    if isinstance(spec.r, bool) or not isinstance(spec.r, int) or spec.r < 1:
        raise ConfigError(f"peft.r={spec.r!r}: must be a positive integer (the adapters' rank). Fix: e.g. r: 16")
    if isinstance(spec.alpha, bool) or not isinstance(spec.alpha, (int, float)) or spec.alpha <= 0:
        raise ConfigError(f"peft.alpha={spec.alpha!r}: must be a positive number (lora_alpha; the update is scaled by "
                          "alpha / r). Fix: e.g. alpha: 32 (twice r)")
    if isinstance(spec.dropout, bool) or not isinstance(spec.dropout, (int, float)) or not 0 <= spec.dropout < 1:
        raise ConfigError(f"peft.dropout={spec.dropout!r}: must be at least 0 and below 1. Fix: e.g. dropout: 0.05")
    targets = spec.target_modules
    if isinstance(targets, (list, tuple)):
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"peft.target_modules={targets!r}: must be module names. Fix: e.g. target_modules: "
                              "[q_proj, k_proj, v_proj, o_proj], or all-linear")
    elif not isinstance(targets, str) or not targets:
        raise ConfigError(f"peft.target_modules={targets!r}: must be all-linear, a list of module names or one "
                          "regular expression. Fix: e.g. target_modules: all-linear")
    saved = spec.modules_to_save
    if saved is None:
        spec.modules_to_save = saved = []
    if not isinstance(saved, (list, tuple)) or not all(isinstance(m, str) and m for m in saved):
        raise ConfigError(f"peft.modules_to_save={saved!r}: must be a list of module names. Fix: e.g. "
                          "modules_to_save: [lm_head]")
    for key in ("use_dora", "use_rslora"):
        if not isinstance(getattr(spec, key), bool):
            raise ConfigError(f"peft.{key}={getattr(spec, key)!r}: must be true or false. Fix: e.g. {key}: false")
    if spec.quantize_base in (None, False):
        spec.quantize_base = ""
    if spec.quantize_base not in ("", "nf4"):
        raise ConfigError(f"peft.quantize_base={spec.quantize_base!r}: the frozen base is quantized to nf4 (QLoRA's "
                          "4-bit NormalFloat, torchao) or not at all. Fix: quantize_base: nf4, or leave it out")
    if spec.quantize_base and spec.use_dora:
        raise ConfigError("peft.use_dora=True: DoRA with a quantized base is not supported (PEFT's DoRA dequantizes "
                          "the base through weight.dequantize(), which torchao's NF4Tensor lacks). Fix: use_dora: "
                          "false, or leave quantize_base out")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"the recipe's peft section ({spec.describe()}) needs the peft package, which is not "
                          f"installed. Fix: {install_command('peft')}, or drop the peft section")
    return spec


def _module_matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def peft_model(model, spec: PeftSpec):
    """``model`` (the causal LM, on the meta device as the command line builds it) wrapped by
    ``peft.get_peft_model`` as ``spec`` says. A ``target_modules`` or ``modules_to_save`` name that matches no
    module of the model is refused (ConfigError) before PEFT sees it; so is a target PEFT cannot adapt."""
    import re

    try:
        from peft import get_peft_model
    except ImportError:
        raise ConfigError(f"the recipe's peft section needs the peft package, which is not installed. Fix: "
                          f"{install_command('peft')}, or drop the peft section") from None
    names = [name for name, _ in model.named_modules() if name]
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if name and not list(m.children()) and not name.rsplit(".", 1)[-1].isdigit()})
    shown = ", ".join(leaves[:16]) + (", ..." if len(leaves) > 16 else "")
    targets = spec.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        if not any(re.fullmatch(targets, name) for name in names):
            raise ConfigError(f"peft.target_modules={targets!r}: as a regular expression it matches no module name "
                              f"of this {kind} model (whole names, e.g. {names[-2]}). Fix: a list of module names, "
                              f"e.g. target_modules: [q_proj, v_proj] (its modules: {shown}), or all-linear")
    for field, wanted in (("target_modules", targets if isinstance(targets, (list, tuple)) else []),
                          ("modules_to_save", spec.modules_to_save)):
        missing = [t for t in wanted if not any(_module_matches(name, t) for name in names)]
        if missing:
            import difflib

            close = difflib.get_close_matches(missing[0].rsplit(".", 1)[-1], leaves, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"peft.{field}={list(wanted)!r}: {', '.join(repr(m) for m in missing)} names no module "
                              f"of this {kind} model{hint}. Fix: use its module names ({shown})"
                              + (", or all-linear" if field == "target_modules" else ""))
    import contextlib

    import torch

    # a model on the meta device gets its adapters there too: PEFT would otherwise make them on the CPU (and draw
    # them) before moving them to the base's device, holding every adapter in each process's memory for nothing
    on_meta = all(p.is_meta for p in model.parameters())
    try:
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = get_peft_model(model, spec.lora_config())
    except (ValueError, TypeError, NotImplementedError) as exc:
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        field, fix = next(((f, fix) for word, f, fix in PEFT_REFUSALS if word in said.lower()),
                          ("target_modules", "target other modules, e.g. target_modules: [q_proj, k_proj, v_proj, "
                                             "o_proj]"))
        raise ConfigError(f"peft.{field}={getattr(spec, field)!r}: PEFT cannot adapt this {kind} model as the recipe "
                          f"says: {said}. Fix: {fix}") from None
    if spec.quantize_base:  # on the meta device: parallelize quantizes each weight whole as it loads it
        from ..interface.model_wrapper import wrapper_of

        wrapper_of(model).quantize_base(spec.quantize_base)
    return model


# what PEFT's refusals name -> (the recipe field, its fix)
PEFT_REFUSALS = (("dropout", "dropout", "dropout: 0.0, or target_modules without the parameters PEFT wraps (a MoE "
                                        "layer's fused experts), e.g. [q_proj, k_proj, v_proj, o_proj]"),
                 ("dora", "use_dora", "use_dora: false, or target_modules PEFT's DoRA supports"),
                 ("modules_to_save", "modules_to_save", "name modules the adapters do not target"),
                 ("rank", "r", "r: 16"))


@dataclasses.dataclass
class Recipe:
    nproc: int
    model: dict[str, Any]
    data: DataSpec
    train: TrainSpec
    parallel: ParallelConfig
    init_from: str = ""  # a pretrained directory: its config.json is the model (a model section must agree in sizes)
    resume_from: str = ""  # a checkpoint (without init_from): the config it was saved with is the model
    peft: PeftSpec | None = None  # adapters on the model (the base frozen); None: every parameter trains

    def to_dict(self) -> dict[str, Any]:
        out = {"nproc": self.nproc, "model": dict(self.model), "data": dataclasses.asdict(self.data),
               "train": dataclasses.asdict(self.train), "parallel": self.parallel.to_dict()}
        if self.peft is not None:
            out["peft"] = self.peft.to_dict()
        return out

    def base_dtype(self) -> dict:
        """How the model is built (``from_config``'s keyword): a PEFT recipe's frozen base in ``peft.base_dtype``;
        otherwise nothing (fp32, transformers' default)."""
        return {"dtype": self.peft.torch_base_dtype} if self.peft is not None else {}

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


PEFT_SHAPES = ("method", "r", "target_modules", "modules_to_save", "use_dora")  # what decides the parameters


def recorded_init_from(path: str) -> str:
    """The ``--init-from`` directory the run that wrote the checkpoint ``path`` started from (``ultrascale.json``,
    ``extra.init_from``), or ""."""
    from ..checkpoints.sharded import read_meta, resolve_checkpoint

    try:
        meta = read_meta(resolve_checkpoint(path))
    except Exception:  # noqa: BLE001 - a missing or broken checkpoint is reported where it is read
        return ""
    value = (meta.get("extra") or {}).get("init_from")
    return value if isinstance(value, str) else ""


def compare_peft_with_checkpoint(peft: PeftSpec | None, path: str, init_from: str | None = None) -> None:
    """Refuse (ConfigError) resuming a checkpoint with a ``peft`` section that builds other parameters than the one
    it was trained with (its recipe is saved in ``ultrascale.json``, ``extra.recipe``); checkpoints without a saved
    recipe are not compared. Without ``init_from`` a PEFT run's frozen base is read again from the directory the
    checkpoint records (``recorded_init_from``): it must be there."""
    from ..checkpoints.sharded import read_meta, resolve_checkpoint

    try:
        meta = read_meta(resolve_checkpoint(path))
    except Exception:  # noqa: BLE001 - a missing or broken checkpoint is reported where it is read
        return
    base = recorded_init_from(path)
    if peft is not None and not init_from and base and not (Path(base) / "config.json").is_file():
        raise ConfigError(f"--resume {path}: the run's frozen base is read again from the directory it started from, "
                          f"'{base}' (its --init-from), which is not a save_pretrained directory here. Fix: pass the "
                          "base with --init-from DIR")
    saved = (meta.get("extra") or {}).get("recipe")
    if not isinstance(saved, dict):
        return
    theirs, mine = saved.get("peft"), peft.to_dict() if peft is not None else None
    if (theirs is None) != (mine is None):
        how = (f"with adapters (peft: {theirs})" if theirs is not None else "without adapters (no peft section)")
        raise ConfigError(f"--resume {path}: the checkpoint was trained {how}, the recipe "
                          f"{'has none' if mine is None else f'adds peft: {mine}'}, so its parameters differ. Fix: "
                          "resume with the peft section the run was started with"
                          + (f" (e.g. --set peft.r={theirs.get('r')})" if theirs is not None else
                             " (drop it: --set peft=null)"))
    if theirs is not None:
        differ = {k: (mine.get(k), theirs.get(k)) for k in PEFT_SHAPES if mine.get(k) != theirs.get(k)}
        if differ:
            what = ", ".join(f"peft.{k}={v!r} (checkpoint: {w!r})" for k, (v, w) in differ.items())
            raise ConfigError(f"--resume {path}: the recipe's {what} builds other adapters than the checkpoint "
                              "holds. Fix: set the checkpoint's values to resume it")


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
                    "train": "{steps: 100, global_batch: 32}", "parallel": "{tp: 2}", "peft": "{method: lora, r: 16}"}


def _check_mapping(data: dict[str, Any], name: str, where: str) -> None:
    """Refuse (ConfigError naming the recipe file and the section) a section that is set but is not a mapping of
    fields (``parallel: [1, 2]``, ``train: 5``), which would otherwise fail deep inside as a TypeError or an
    AttributeError; absent or null is an empty section."""
    value = data.get(name)
    if value is None or isinstance(value, dict):
        return
    kind = type(value).__name__
    article = "an" if kind[0] in "aeiou" else "a"
    raise ConfigError(f"{where}: {name} is {article} {kind} ({value!r}). Fix: write it as a mapping of fields, e.g. "
                      f"{name}: {SECTION_EXAMPLES[name]}")


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
            from ..interface.plugins import get_plugin_manager

            ga = get_plugin_manager().hook.ultrascale_microbatches(config=resolved) or 1
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
    hook every front end's layout goes through (``ultrascale_resolve_layout``: the planner), and its micro-batch
    size (the chosen layout's ``auto_micro_batch_size``), unless the recipe sets its split."""
    from ..interface.plugins import get_plugin_manager

    auto = parallel.replace(auto_seq_len=data_spec.seq_len, auto_global_batch=train.global_batch)
    chosen = get_plugin_manager().hook.ultrascale_resolve_layout(config=auto, model_config=model_config,
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
    for key in data:
        if key not in SECTIONS:
            raise ConfigError(f"unknown recipe key '{key}': {suggest(key, SECTIONS)}")
    nproc = data.get("nproc", 1)
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc={nproc!r}: must be a positive integer. Fix: e.g. nproc: 4")
    where = str(path) if path is not None else "the default recipe"
    for name in SECTION_EXAMPLES:
        _check_mapping(data, name, where)
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
    peft = peft_spec(data.get("peft"))
    world = world_size or nproc * nnodes
    recipe = Recipe(nproc=nproc, model=model, data=data_spec, train=train, parallel=parallel,
                    init_from=str(init_from or ""), resume_from="" if init_from else str(resume_from or ""),
                    peft=peft)
    own = own_model_section(path, overrides, model)
    if not (init_from or resume_from):
        model_config_of(model, where=where)  # its keys, then its values as transformers checks them
    elif recipe.init_from and own:  # the pretrained weights' config.json is the model
        compare_with_pretrained(own, recipe.model_config(), f"--init-from {init_from}")
    elif recipe.resume_from:
        compare_with_checkpoint(own, recipe.model_config(), f"--resume {resume_from}")
    if resume_from:
        compare_peft_with_checkpoint(peft, resume_from, init_from)
    if getattr(parallel, "layout", "manual") == "auto":
        parallel, train = _auto_layout(parallel, train, data_spec, recipe.model_config(), world)
    train, parallel = resolve_batching(train, parallel, world)
    return dataclasses.replace(recipe, train=train, parallel=parallel)

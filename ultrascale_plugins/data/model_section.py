"""A recipe's ``model`` section against transformers' config class of its model type: every key must be one the
class has a place for or takes, else it is refused with the likely key. transformers keeps a key its config class
does not know as a plain attribute nobody reads (the model then gets the default of the field that was meant), so
the recipe checks the keys itself, as it does every other section's."""
from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from ..interface.config import ConfigError


def read_config_json(path: Path, where: str) -> dict:
    """The keys of the ``config.json`` at ``path`` (``where`` names it to the user: ``--model X``, ``--init-from
    DIR``): a file that is not JSON, or not a mapping, is refused in one line naming it and where it breaks."""
    import json

    try:
        fields = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:  # a truncated or hand-edited file: say where the JSON breaks
        raise ConfigError(f"{where}: {path} is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}). "
                          "Fix: correct the file, or write it again with save_pretrained") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {path} cannot be read ({exc}). Fix: give a readable config.json") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{where}: {path} holds a JSON {type(fields).__name__}, not a mapping of config fields. "
                          "Fix: give a Hugging Face config.json ({\"model_type\": ..., ...})")
    return fields


# huggingface_hub's strict dataclasses (transformers 5's configs) name the field in the message only
_REFUSED_FIELD = re.compile(r"Validation error for field '(\w+)'")


def config_from_fields(fields: dict, where: str, prefix: str = ""):
    """transformers' config of ``fields`` (a recipe's model section, a config.json's keys; ``model_type`` among
    them), each value as transformers checks it: a value it refuses (transformers 5 checks each field's type, and
    its config class's rules) is said in one line naming ``where`` (the file), the field (``prefix`` + its name,
    e.g. ``model.``), the value and a fix, not as transformers' traceback."""
    from transformers import AutoConfig

    spec = dict(fields)
    model_type = spec.pop("model_type")
    config_class(model_type, field=f"{where}: {prefix}model_type")  # an unknown type: the closest known one
    try:
        return AutoConfig.for_model(model_type, **spec)
    except Exception as exc:  # noqa: BLE001 - transformers' refusals of a value: ValueError, TypeError, strict checks
        raise ConfigError(refused_value_line(exc, fields, where, prefix)) from None


def refused_value_line(exc: Exception, fields: dict, where: str, prefix: str = "") -> str:
    """One line for transformers' refusal ``exc`` of a config built from ``fields``: the field it names (a strict
    dataclass's field check) with the value given and the class default as the example, else what it said."""
    model_type = fields.get("model_type")
    said = " ".join(str(exc.__cause__ or exc).split()).rstrip(".") or type(exc).__name__
    named = _REFUSED_FIELD.search(str(exc))
    try:
        cls = config_class(model_type, where)
    except ConfigError:
        cls = None
    owner = f"transformers' {cls.__name__}" if cls is not None else f"transformers' {model_type} config"
    if named and named.group(1) in fields:
        field = named.group(1)
        example = getattr(_default_instance(cls), field, None) if cls is not None else None
        fix = f"e.g. {field}: {example}" if example is not None else f"correct {prefix}{field}"
        return f"{where}: {prefix}{field}={fields[field]!r}: {owner} refuses it ({said}). Fix: {fix}"
    return f"{where}: {owner} refuses the {prefix.rstrip('.') or 'config'}: {said}. Fix: correct the field it names"


@functools.lru_cache(maxsize=None)
def _default_instance(cls):
    try:
        return cls()
    except Exception:  # noqa: BLE001 - a class without a default instance: no example value to give
        return None


def check_model_section(model: dict, where: str = "model") -> None:
    """Refuse (ConfigError, naming the key and the likely fix) a key of a recipe's ``model`` section that the model
    type's config class neither has nor takes: its fields (the base class's too), their ``attribute_map`` aliases,
    settable properties, the attributes its default instance carries (``config_keys``), the attributes its model
    code reads without declaring them (``code_reads``: Qwen3-MoE's ``head_dim``), and the legacy names transformers
    itself still turns into fields (``rope_scaling``, ``rope_theta``, ``torch_dtype``, ...). Generation settings, which
    transformers drops from a model's config, are refused too. A sub-config given as a mapping (``text_config``)
    is checked against its own class."""
    model_type = model.get("model_type")
    if not model_type:
        raise ConfigError(f"{where}.model_type is missing. Fix: add e.g. model_type: llama to the model section")
    _check_keys(config_class(model_type, where), model, where)


def _check_keys(cls, section: dict, where: str, default=None) -> None:
    """``section``'s keys against ``cls``; ``default``: the instance a composite config makes of this sub-config,
    whose attributes count as known too (a composite hands its sub-configs keys of its own, e.g. LLaVA's vision
    config gets the vocabulary size)."""
    known, subconfigs = config_keys(cls)
    if default is not None:
        known = known | _instance_keys(default)
        subconfigs = {**subconfigs, **_subconfigs_of(default)}
    for key, value in section.items():
        if key == "model_type":
            continue
        if key in subconfigs and isinstance(value, dict):
            sub, inner = subconfigs[key], value.get("model_type")
            if inner and inner != getattr(sub, "model_type", None):  # another class than the default's
                _check_keys(config_class(inner, f"{where}.{key}"), value, f"{where}.{key}")
            else:
                _check_keys(type(sub), value, f"{where}.{key}", sub)
        elif key not in known and key not in code_reads(cls) and not _taken_as_legacy(cls, key, value):
            raise ConfigError(_unknown_key_line(cls, where, key, value, known))


# getattr(config, "head_dim", ...) / hasattr(self.config, "x"): an attribute the model reads if a config has it
_READS = re.compile(r"""(?:get|has)attr\(\s*[\w.]*config\w*\s*,\s*["'](\w+)["']""")
# transformers' modules every model's code runs through (RoPE, masks, loading, attention kernels)
_SHARED_CODE = ("modeling_rope_utils.py", "modeling_utils.py", "masking_utils.py", "integrations/*.py")


def code_reads(cls) -> frozenset:
    """The attributes transformers' code reads from a config of ``cls`` without declaring them as fields (e.g.
    Qwen3-MoE's ``head_dim``: ``getattr(config, "head_dim", hidden_size // heads)``): the names its model
    directory's modules and the shared modeling modules ask ``getattr``/``hasattr`` for. Read as text, nothing is
    imported."""
    import sys

    module = sys.modules.get(cls.__module__)
    folder = Path(module.__file__).parent if getattr(module, "__file__", None) else None
    own = tuple(str(f) for f in folder.glob("*.py") if not f.name.startswith("modular_")) if folder else ()
    return _reads_in(own) | _shared_reads()


@functools.lru_cache(maxsize=None)
def _shared_reads() -> frozenset:
    import transformers

    root = Path(transformers.__file__).parent
    return _reads_in(tuple(str(f) for pattern in _SHARED_CODE for f in sorted(root.glob(pattern))))


@functools.lru_cache(maxsize=None)
def _reads_in(files: tuple) -> frozenset:
    names = set()
    for file in files:
        try:
            names |= set(_READS.findall(Path(file).read_text(encoding="utf-8")))
        except OSError:
            pass
    return frozenset(names)


def _instance_keys(config) -> set:
    """The attributes a config instance carries and the keys its ``to_dict`` writes (config.json's keys: a few
    classes write names only their ``from_dict`` reads, e.g. timm's ``num_classes``)."""
    try:
        written = set(config.to_dict())
    except Exception:  # noqa: BLE001 - a config that does not serialize: its attributes are what it has
        written = set()
    return set(vars(config)) | written


def _subconfigs_of(config) -> dict:
    from transformers import PretrainedConfig

    return {name: value for name, value in vars(config).items() if isinstance(value, PretrainedConfig)}


def config_class(model_type, where: str = "model", field: str = ""):
    """transformers' config class of ``model_type`` (``CONFIG_MAPPING``); an unknown type is refused with the
    closest known one, naming ``field`` (default: ``where``.model_type)."""
    import difflib

    from transformers import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
    hint = f"did you mean '{close[0]}'?" if close else "not a transformers model type"
    field = field or f"{where}.model_type"
    raise ConfigError(f"{field}={model_type!r}: {hint} Fix: use a transformers model type such as llama, "
                      "qwen2, qwen3_moe, mistral or gpt2")


@functools.lru_cache(maxsize=None)
def config_keys(cls) -> tuple[frozenset, dict]:
    """(every key ``cls`` has a place for, {sub-config key: the default instance's sub-config}). transformers 5
    configs are dataclasses (5.17 and 5.25 alike): their fields, the base class's included; older ones name theirs
    in ``__init__``. Both are read, with ``attribute_map`` (aliases and their targets), properties with a setter
    (``rope_scaling``, ``num_labels``, ``torch_dtype``), class-level settings an instance may override
    (``base_model_tp_plan``) and what a default instance carries (attributes set by
    ``__post_init__``, e.g. derived fields, and the keys its ``to_dict`` writes)."""
    import inspect

    names = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        try:
            names |= {n for n, p in inspect.signature(klass.__init__).parameters.items()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
        except (TypeError, ValueError):
            pass
        names |= {n for n, v in vars(klass).items() if isinstance(v, property) and v.fset is not None}
        if klass is not object:  # class-level settings an instance may override: base_model_tp_plan, ...
            names |= {n for n, v in vars(klass).items() if not n.startswith("_") and not callable(v)
                      and not isinstance(v, (property, classmethod, staticmethod))}
    aliases = getattr(cls, "attribute_map", None) or {}
    names |= set(aliases) | set(aliases.values())
    subconfigs = {}
    try:  # transformers' own defaults, which every config class has
        default = cls()
    except Exception:  # noqa: BLE001 - a class without a default instance is checked by its declared names
        default = None
    if default is not None:
        names |= _instance_keys(default)
        subconfigs = _subconfigs_of(default)
    return frozenset(names), subconfigs


def _taken_as_legacy(cls, key: str, value) -> bool:
    """Whether transformers' ``cls`` takes ``key`` by a name it does not keep (a legacy name it turns into a field,
    e.g. ``rope_theta`` into ``rope_parameters``): built with it alone, the config does not hold it as an
    attribute of its own. Generation settings are taken but dropped: they count as not taken."""
    if key in generation_keys() or isinstance(getattr(cls, key, None), property):  # read-only: use_return_dict
        return False
    import logging

    said = logging.getLogger("transformers")
    level = said.level
    said.setLevel(logging.CRITICAL)  # a trial, not the user's config: transformers' logs are noise
    try:
        built = cls(**{key: value})
    except (AttributeError, TypeError):  # a class that takes no such key
        return False
    except Exception:  # noqa: BLE001 - transformers read the key and refused its value: said when the config is built
        return True
    finally:
        said.setLevel(level)
    return key not in vars(built)


@functools.lru_cache(maxsize=None)
def generation_keys() -> frozenset:
    """The generation settings transformers drops from a model's config (they live in ``generation_config.json``)."""
    try:
        from transformers import GenerationConfig

        return frozenset(GenerationConfig._get_default_generation_params())
    except Exception:  # noqa: BLE001 - a transformers without that list: nothing is known to be dropped
        return frozenset()


def _unknown_key_line(cls, where: str, key: str, value, known: frozenset) -> str:
    import difflib

    if key in generation_keys():
        return (f"{where}.{key}={value!r}: a generation setting, which transformers drops from a model's config "
                f"({cls.__name__}): it would change nothing. Fix: remove it from the model section")
    public = sorted(n for n in known if not n.startswith("_"))
    close = difflib.get_close_matches(str(key), public, n=1)
    if close:
        hint, fix = f"did you mean '{close[0]}'?", f"{close[0]}: {value} (--set {where}.{close[0]}={value})"
    else:  # the fields and their aliases: what a model section sets (not every name transformers would take)
        fields = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(public))
        fields |= set(getattr(cls, "attribute_map", None) or {})
        listed = sorted(n for n in fields if not n.startswith("_"))
        hint, fix = f"valid keys: {', '.join(listed)}", "remove it, or use one of the valid keys"
    return (f"unknown key '{where}.{key}': {hint} (transformers' {cls.__name__} has no such field: it would keep the "
            f"value unused and give the model that field's default). Fix: {fix}")

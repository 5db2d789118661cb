"""Configuration fields contributed by plugins (pytest's ``addoption`` is the model).

Every dimension declares its own layout fields in ``ultrascale_declare_fields(fields)``::

    @hookimpl
    def ultrascale_declare_fields(fields):
        fields.add("tp", int, 1, "tensor-parallel degree", minimum=1)

A field is typed, has a default and may restrict its values; ``ParallelConfig`` accepts exactly the fields the
installed plugins declare, so a third party's field is valid in YAML recipes, ``--set``, ``UltraScaleStrategy(...)``
and the Accelerate ``ultrascale:`` block with no change to the package.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable


class ConfigError(ValueError):
    """A layout or recipe that cannot run. The message names the field, the value and the fix."""


def field_error(field: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{field}={value!r}: {problem}. Fix: {fix}")


# The names people know the dimensions by (Accelerate's, Megatron's, the papers'), for suggestions.
ALIASES = {"tensor_parallel": "tp", "tensor_parallel_size": "tp", "tp_size": "tp", "pipeline_parallel": "pp",
           "pipeline_parallel_size": "pp", "pp_size": "pp", "context_parallel": "cp", "cp_size": "cp",
           "data_parallel": "dp_shard", "dp": "dp_shard", "zero": "zero_stage", "fsdp": "zero_stage",
           "recompute": "activation_checkpointing", "gradient_checkpointing": "activation_checkpointing",
           "sp": "sequence_parallel"}


def suggest(name: str, choices) -> str:
    choices = list(choices)
    if ALIASES.get(name) in choices:
        return f"did you mean '{ALIASES[name]}'?"
    close = difflib.get_close_matches(name, choices, n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(choices))}"


AUTO = "auto"  # the value a field with ``auto`` takes to be derived from the rest of the layout
TYPES = {int: "an integer", bool: "true or false", str: "a string", float: "a number", list: "a list"}


@dataclasses.dataclass(frozen=True)
class Field:
    """One layout field. ``check(value)`` returns None or ``(problem, fix)`` for values the type and ``choices``
    / ``minimum`` do not rule out; ``optional`` allows None. ``auto`` (a function of the layout) lets the field
    also take the value ``"auto"``, which ``ParallelConfig.resolve`` replaces by ``auto(resolved_config)``.
    ``ask``: the question ``ultrascale accelerate-config --interactive`` asks for the field ("": it is left at its
    default), asked when ``ask_when(answers so far)`` is true, or always without one (``pp_schedule`` is asked
    once ``pp`` > 1). ``words``: how the layout line (``ParallelDims.describe``) says a value set away from the
    default (a function of the value, e.g. ``"activation checkpointing=full"``); without it, a flag switched on is
    said by its name and any other value as ``name=value``. ``dry_run``: why the dry run (``us.dry_run``, one step
    on fake tensors and a fake process group) cannot run a value away from the default yet, said when it refuses
    one ("": it runs every value); or a function of the layout that says why for the layouts it cannot run ("" for
    the others), where only some values, or some combinations, are not run yet."""

    name: str
    type: type
    default: Any
    help: str
    plugin: str = ""
    choices: tuple | None = None
    minimum: int | float | None = None
    optional: bool = False
    check: Callable[[Any], tuple[str, str] | None] | None = None
    auto: Callable[[Any], Any] | None = None
    ask: str = ""
    ask_when: Callable[[dict], bool] | None = None
    words: Callable[[Any], str] | None = None
    dry_run: str | Callable[[Any], str] = ""

    def said(self, value: Any) -> str:
        """``value`` (away from the default) as the layout line says it."""
        if self.words is not None:
            return self.words(value)
        return self.name if value is True else f"{self.name}={value}"

    def asked(self, answers: dict) -> bool:
        """Whether the interactive configuration asks for this field, given the ``answers`` so far."""
        return bool(self.ask) and (self.ask_when is None or bool(self.ask_when(answers)))

    def prompt(self) -> str:
        """The interactive question, with the field's name and the values it takes."""
        kinds = "/".join(map(str, self.choices)) if self.choices else ("true/false" if self.type is bool else "")
        return f"{self.ask} ({self.name}{': ' + kinds if kinds else ''})?"

    def validate(self, value: Any) -> Any:
        """The value, checked (lists are copied); a ConfigError naming the field, the value and the fix."""
        if value is None and self.optional:
            return None
        if self.auto is not None and value == AUTO:
            return value
        if isinstance(value, bool) and self.type is str and self.choices and str(value).lower() not in self.choices:
            # YAML 1.1 reads an unquoted no/off as false and yes/on as true: `mixed_precision: no` means "no"
            spelled = [c for c in self.choices if c in (("no", "off", "false") if not value else ("yes", "on", "true"))]
            if spelled:
                value = spelled[0]
        example = f"e.g. {self.name}: {self.default!r}" if self.default is not None else f"set {self.name}"
        wrong_type = (isinstance(value, bool) and self.type is not bool) or not isinstance(
            value, (int, float) if self.type is float else self.type)
        if wrong_type:
            kind = TYPES.get(self.type, self.type.__name__) + (f" or {AUTO}" if self.auto is not None else "")
            raise field_error(self.name, value, f"must be {kind}", example)
        if self.choices is not None and value not in self.choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise field_error(self.name, value, f"unknown value; one of {', '.join(map(str, self.choices))}",
                              f"{hint}pick one of those")
        if self.minimum is not None and value < self.minimum:
            raise field_error(self.name, value, f"must be at least {self.minimum}", example)
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise field_error(self.name, value, *problem)
        return list(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class Fact:
    """One fact a plugin decides for the others (``LayoutFacts``): its name, the value that holds until the plugin
    answers otherwise for a layout (``ultrascale_declare_facts``), what it says, and the plugin that owns it."""

    name: str
    default: Any
    help: str
    plugin: str = ""


class Fields:
    """What ``ultrascale_declare_fields`` declares: one ``Field`` per layout field and one ``Fact`` per fact, each by
    name, in declaration order."""

    def __init__(self) -> None:
        self.by_name: dict[str, Field] = {}
        self.facts: dict[str, Fact] = {}
        self.plugin = ""  # set by the caller while one plugin's hook runs

    def fact(self, name: str, default: Any, help: str) -> None:
        """Declare a fact this plugin decides for the others, answered per layout in its ``ultrascale_declare_facts``
        (``default`` holds when it does not answer); a fact has one owner."""
        if name in self.facts:
            raise ConfigError(f"layout fact '{name}' is declared by both '{self.facts[name].plugin}' and "
                              f"'{self.plugin}'. Fix: rename one of them")
        self.facts[name] = Fact(name, default, help, self.plugin)

    def add(self, name: str, type: type, default: Any, help: str, *, choices=None, minimum=None,
            optional: bool = False, check=None, auto=None, ask: str = "", ask_when=None, words=None,
            dry_run: str | Callable[[Any], str] = "") -> None:
        if name in self.by_name:
            raise ConfigError(f"layout field '{name}' is declared by both '{self.by_name[name].plugin}' and "
                              f"'{self.plugin}'. Fix: rename one of them")
        field = Field(name, type, default, help, self.plugin, tuple(choices) if choices is not None else None,
                      minimum, optional, check, auto, ask, ask_when, words, dry_run)
        if default is not None or not optional:
            field.validate(default)  # a plugin's own default must be valid
        self.by_name[name] = field

    def __iter__(self):
        return iter(self.by_name.values())

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

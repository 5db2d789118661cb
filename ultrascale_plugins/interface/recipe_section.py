"""A section of the command line's recipe that a plugin owns (``ultrascale_declare_recipe_sections``): the recipe's own
sections are ``nproc``, ``model``, ``data``, ``train`` and ``parallel``; a feature configured from the recipe
(PEFT's ``peft:``) declares its section here, so the recipe reads, checks, saves, applies and compares it without
knowing the feature.

The recipe asks a section, in this order: ``read`` the YAML value (before any worker starts: every bad value one
line naming the field), ``check_resume`` against the run a checkpoint was saved from, ``model_kwargs`` when it
builds the model, ``apply`` to the model it built (on the meta device), ``to_dict`` when it saves the recipe in a
checkpoint and ``describe`` for the run's first line."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """What a checkpoint says of the run that wrote it: ``path`` (as the user gave it), the ``recipe`` it saved
    (its sections as plain values; None when it saved none) and the ``init_from`` directory it started from
    ("" when none)."""

    path: str
    recipe: dict | None
    init_from: str


class RecipeSection(abc.ABC):
    """One recipe section: its key ``name`` and an ``example`` value for refusals (``{method: lora, r: 16}``).
    A section absent from the recipe, or null, reads as None; the other methods get the value ``read`` gave."""

    name: str = ""
    example: str = ""

    @abc.abstractmethod
    def read(self, value: Any) -> Any:
        """The section's value checked and typed, or None when ``value`` is None; a ``fields.ConfigError`` naming
        ``<name>.<field>``, the value and a fix for a bad one."""

    def to_dict(self, spec: Any) -> dict:
        """``spec`` as the plain values a recipe file holds (saved with every checkpoint)."""
        return dataclasses.asdict(spec)

    def describe(self, spec: Any) -> str:
        """``spec`` in a few words, for the run's first line."""
        return f"{self.name}: {self.to_dict(spec)}"

    def model_kwargs(self, spec: Any) -> dict:
        """Keywords of ``from_config`` / ``from_pretrained`` the section asks for (a frozen base's dtype)."""
        return {}

    def apply(self, model, spec: Any):
        """``model`` (built on the meta device) with the section applied; the model itself when it changes
        nothing. The engine then parallelizes what this returns."""
        return model

    def checkpoint_holds_whole_model(self, spec: Any) -> bool:
        """Whether a checkpoint of a run with ``spec`` holds every parameter; False (adapters only) makes a resume
        without ``--init-from`` read the rest again from the directory the run started from."""
        return True

    def check_resume(self, spec: Any, saved: SavedRun, init_from: str | None) -> None:
        """Refuse (``ConfigError``) resuming ``saved`` with ``spec`` (None: the recipe has no such section) when
        they build other parameters."""

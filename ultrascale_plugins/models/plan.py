"""ModelPlan: what the dimensions need to know about one model's structure, by module name (FQN)."""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any, Callable

from torch import nn


@dataclasses.dataclass
class ModelPlan:
    """Module names are full FQNs from the causal-LM root; ``tp_plan`` keys may use ``*`` wildcards.

    ``styles`` adds style names (name -> factory(sequence_parallel=bool, loss_parallel=bool) -> ParallelStyle)
    for architectures whose layers torch's built-in styles cannot shard (e.g. GPT-2's fused Conv1D).
    """

    tp_plan: dict[str, str]
    layers: list[str]
    norms: list[str] = dataclasses.field(default_factory=list)
    regions: list[str] = dataclasses.field(default_factory=list)
    embedding: str | None = None
    lm_head: str | None = None
    tied: bool = False
    styles: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)

    def matches(self, model: nn.Module) -> dict[str, str]:
        """Expand the wildcard plan against the model: {module FQN: style name}."""
        out: dict[str, str] = {}
        for fqn, _ in model.named_modules():
            for pattern, style in self.tp_plan.items():
                if fqn == pattern or fnmatch.fnmatchcase(fqn, pattern):
                    out[fqn] = style
        return out


def _fqn_of(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    for fqn, mod in model.named_modules():
        if mod is target:
            return fqn
    return None


def hf_plan_from_model(model: nn.Module, tp_plan: dict[str, str]) -> ModelPlan:
    """Derive layers, norms, TP regions, embedding and head of a Hugging Face decoder from its module tree.

    ``tp_plan`` is the full-FQN plan. Regions are the parents of the column-parallel layers inside decoder
    layers (attention, MLP): their input is all-gathered over the sequence under sequence parallel. Norms are
    the normalisation modules outside those regions (sequence-sharded under sequence parallel).
    """
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [fqn for fqn, m in model.named_modules() if type(m).__name__ in block_names]
    matched = ModelPlan(tp_plan=tp_plan, layers=layers).matches(model)
    regions = sorted({fqn.rsplit(".", 1)[0] for fqn, style in matched.items()
                      if "colwise" in style and any(fqn.startswith(layer + ".") for layer in layers)},
                     key=_natural)
    norms = [fqn for fqn, m in model.named_modules()
             if re.search(r"norm", type(m).__name__, re.I) and fqn
             and not any(fqn == r or fqn.startswith(r + ".") for r in regions)]
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = bool(embed is not None and head is not None and head.weight is embed.weight)
    return ModelPlan(tp_plan=tp_plan, layers=layers, norms=norms, regions=regions,
                     embedding=_fqn_of(model, embed), lm_head=_fqn_of(model, head), tied=tied)


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]

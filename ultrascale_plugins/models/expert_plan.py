"""Tensor-parallel plan entries for fused mixture-of-experts weights that the model's TP plan leaves out.

transformers up to 5.24 sharded a MoE block's fused expert weights under tensor parallel (``moe_tp_experts``
with ``packed_colwise``/``rowwise`` on the 3-D weights). From 5.25 those entries moved to the expert-parallel
plan (``base_model_ep_plan``: ``ep_dispatch_experts`` + ``grouped_gemm``) and the TP plan no longer names the
experts, so under TP alone every rank would hold every expert whole, and under sequence parallel the MoE block
would not be a TP region. We have no expert parallelism; we shard the experts by their intermediate dimension
instead, as before. The layout is read from the metadata transformers' ``use_experts_implementation`` puts on
the experts module (gated or not, transposed, concatenated gate|up, biases, post-expert norm); an experts
module without that metadata, or with a layout the styles cannot shard exactly, is left out (replicated whole,
which is correct, only less memory-efficient).
"""
from __future__ import annotations

import fnmatch

from torch import nn


def expert_tp_entries(model: nn.Module, ep_plan: dict[str, str], tp_plan: dict[str, str]) -> dict[str, str]:
    """Plan entries (full-FQN patterns, from ``ep_plan``'s ``ep_dispatch_experts`` keys) for the experts
    modules that ``tp_plan`` does not already cover."""
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for pattern, style in ep_plan.items():
        if style != "ep_dispatch_experts":
            continue
        if any(_covers(key, pattern) for key in tp_plan):  # the model's own TP plan names these experts
            continue
        found = [m for fqn, m in modules.items() if fnmatch.fnmatchcase(fqn, pattern)]
        layouts = {_layout(m) for m in found}
        if len(layouts) != 1 or None in layouts:
            continue
        out.update({(f"{pattern}.{p}" if p else pattern): s for p, s in layouts.pop()})
    return out


def _covers(key: str, pattern: str) -> bool:
    return key == pattern or key.startswith(pattern + ".")


def _layout(experts: nn.Module) -> tuple[tuple[str, str], ...] | None:
    meta = {a: getattr(experts, a, None) for a in
            ("has_gate", "is_transposed", "is_concatenated", "has_bias", "has_post_expert_norm")}
    if any(v is None for v in meta.values()):
        return None  # not a transformers experts-implementation module: layout unknown
    if meta["has_bias"] or meta["has_post_expert_norm"]:
        return None  # a bias or norm per expert would be applied once per rank by a summed-output style
    up = "gate_up_proj" if meta["has_gate"] else "up_proj"
    params = {name for name, _ in experts.named_parameters()}
    if params != {up, "down_proj"} or getattr(experts, up).dim() != 3 or experts.down_proj.dim() != 3:
        return None
    if meta["has_gate"] and not meta["is_concatenated"]:
        return None  # interleaved gate/up: a strided shard of two halves would pair the wrong features
    # Shard the intermediate dimension: the output side of the up projection, the input side of down.
    # Non-transposed weights are [experts, out, in]; transposed ones [experts, in, out].
    if meta["is_transposed"]:
        up_style = "packed_rowwise" if meta["has_gate"] else "rowwise"
        down_style = "colwise"
    else:
        up_style = "packed_colwise" if meta["has_gate"] else "colwise"
        down_style = "rowwise"
    return (("", "moe_tp_experts"), (up, up_style), ("down_proj", down_style))

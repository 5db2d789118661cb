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

The same plans leave most MoE blocks' shared experts (a dense MLP beside the routed experts) whole on every rank,
where DeepSeek-V3's own plan and Megatron shard them like any MLP: the block's output is then one sum of partial
outputs (experts + shared expert), reduced once, where a whole shared expert's output added to the experts'
partial sum needs that sum first. ``shared_expert_entries`` shards them the same way: gate and up
column-parallel, down row-parallel.
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


def shared_expert_entries(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """Plan entries for the plain MLPs beside the experts that ``tp_plan`` shards (``moe_tp_experts``): a
    sibling module of the experts holding exactly ``gate_proj``, ``up_proj`` and ``down_proj`` (or ``up_proj``
    and ``down_proj``, or a concatenated ``gate_up_proj`` and ``down_proj``: a packed shard), bias-free
    ``nn.Linear`` layers from the hidden size to one intermediate size and back, that the plan does not already
    name; or the same as bare 3-D parameters of several shared experts (``_bare_layout``). (The values of each such layout are proven by the compatibility sweep: an interleaved gate|up would
    not reproduce one process.)"""
    patterns = [pattern for pattern, style in tp_plan.items() if style == "moe_tp_experts"]
    out: dict[str, str] = {}
    for fqn, experts in model.named_modules():
        if not any(fnmatch.fnmatchcase(fqn, pattern) for pattern in patterns):
            continue
        parent = fqn.rpartition(".")[0]
        for name, sibling in model.get_submodule(parent).named_children():
            layout = (_mlp_layout(sibling) or _bare_layout(sibling)) if sibling is not experts else None
            wanted = {".".join(filter(None, (parent, name, child))): style for child, style in layout or ()}
            if wanted and not any(_covers(entry, key) or fnmatch.fnmatchcase(entry, key)
                                  for entry in wanted for key in tp_plan):
                out.update(wanted)
    return out


def _mlp_layout(module: nn.Module) -> tuple[tuple[str, str], ...] | None:
    children = dict(module.named_children())
    linears = {n: c for n, c in children.items() if isinstance(c, nn.Linear)}
    if set(linears) not in ({"gate_proj", "up_proj", "down_proj"}, {"up_proj", "down_proj"},
                            {"gate_up_proj", "down_proj"}):
        return None
    if any(c.bias is not None for c in linears.values()) or any(True for _ in module.named_parameters(recurse=False)):
        return None
    if any(any(True for _ in c.parameters()) for n, c in children.items() if n not in linears):
        return None  # another child with parameters (a norm inside the MLP): not a plain MLP
    down = linears["down_proj"]
    if "gate_up_proj" in linears:  # concatenated [gate | up] (MiniMax-M3's chunk(2)): each rank its half of both
        if linears["gate_up_proj"].weight.shape != (2 * down.in_features, down.out_features):
            return None
        return ("down_proj", "rowwise"), ("gate_up_proj", "packed_colwise")
    ins = {c.weight.shape for n, c in linears.items() if n != "down_proj"}
    if ins != {(down.in_features, down.out_features)}:
        return None
    return tuple((n, "rowwise" if n == "down_proj" else "colwise") for n in sorted(linears))


def _bare_layout(module: nn.Module) -> tuple[tuple[str, str], ...] | None:
    """Shared experts held as bare 3-D parameters (Inkling's: ``gate_proj``/``up_proj`` ``[n, I, H]``, ``down_proj``
    ``[n, H, I]``, applied by batched matmuls and summed over the n experts): sharded by the intermediate dim, run
    as tensor-parallel experts (their output a partial addend). I must differ from H, so the shapes say which side
    is which."""
    own = dict(module.named_parameters(recurse=False))
    if set(own) not in ({"gate_proj", "up_proj", "down_proj"}, {"up_proj", "down_proj"}):
        return None
    if any(True for child in module.children() for _ in child.parameters()) or own["down_proj"].dim() != 3:
        return None
    n, hidden, inter = own["down_proj"].shape
    if hidden == inter or any(own[k].shape != (n, inter, hidden) for k in own if k != "down_proj"):
        return None
    return (("", "moe_tp_experts"), *((k, "colwise") for k in sorted(own) if k != "down_proj"),
            ("down_proj", "rowwise"))


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

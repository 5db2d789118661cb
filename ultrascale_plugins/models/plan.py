"""ModelPlan: what the dimensions need to know about one model's structure, by module name (FQN)."""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any, Callable

from torch import nn

# transformers' TP style names by what they do to the data flowing through a TP region.
COLWISE = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise", "unit_colwise"}
ROWWISE = {"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise", "unit_rowwise"}
EXPERTS = {"moe_tp_experts"}


@dataclasses.dataclass
class ModelPlan:
    """Module names are full FQNs from the causal-LM root; ``tp_plan`` keys may use ``*`` wildcards and may
    name a module or a parameter (transformers shards the fused expert weights by parameter name).

    ``styles`` adds style names (name -> factory(sequence_parallel=bool, loss_parallel=bool) -> ParallelStyle)
    for architectures whose layers torch's built-in styles cannot shard (e.g. GPT-2's fused Conv1D).
    """

    tp_plan: dict[str, str]
    layers: list[str]
    regions: list[str] = dataclasses.field(default_factory=list)
    embedding: str | None = None
    lm_head: str | None = None
    tied: bool = False
    styles: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    root: str = ""  # where the causal LM the plan was made for sits in the model (a wrapper's, e.g. PEFT's)
    # modules whose parameters are data-parallel in a mesh view (exact FQNs -> view name: PlanEdit.views)
    views: dict[str, str] = dataclasses.field(default_factory=dict)

    def rerooted(self, prefix: str) -> "ModelPlan":
        """The same plan with every module name seen from a wrapper that holds the model at ``prefix``."""
        def name(fqn):
            return f"{prefix}.{fqn}" if fqn is not None else None

        return dataclasses.replace(self, tp_plan={name(k): v for k, v in self.tp_plan.items()},
                                   layers=[name(f) for f in self.layers], regions=[name(f) for f in self.regions],
                                   embedding=name(self.embedding), lm_head=name(self.lm_head),
                                   root=name(self.root) if self.root else prefix,
                                   views={name(k): v for k, v in self.views.items()})

    def edited(self, model: nn.Module, edits) -> "ModelPlan":
        """This plan with the plugins' ``PlanEdit``s (``ultrascale_declare_plan_edit``) applied to ``model``: the
        entries become exact names (a wildcard entry cannot leave out one module it matches), each edit's
        entries replace or remove them, and the regions are recomputed."""
        from ..interface.fields import ConfigError

        wanted: dict[str, str | None] = {}
        owner: dict[str, int] = {}
        styles = dict(self.styles)
        views = dict(self.views)
        modules = [fqn for fqn, _ in model.named_modules()]
        for edit in edits:
            for pattern, view in edit.views.items():
                for fqn in _expand({pattern: view}, modules):
                    if views.get(fqn, view) != view:
                        raise ConfigError(f"two plugins put '{fqn}' in different mesh views ({views[fqn]!r} and "
                                          f"{view!r}). Fix: unregister one of them (ULTRASCALE_PLUGINS)")
                    views[fqn] = view
        names = [fqn for fqn, _ in model.named_modules()] + [
            fqn for fqn, _ in model.named_parameters(remove_duplicate=False)]
        for i, edit in enumerate(edits):
            styles.update(edit.styles)
            for pattern, style in edit.entries.items():
                for fqn in [pattern] if pattern in names else _expand({pattern: "x"}, names):
                    if fqn in wanted and wanted[fqn] != style and owner[fqn] != i:
                        raise ConfigError(f"two plugins give '{fqn}' different tensor-parallel styles "
                                          f"({wanted[fqn]!r} and {style!r}) in their ultrascale_declare_plan_edit. Fix: "
                                          "unregister one of them (ULTRASCALE_PLUGINS)")
                    wanted[fqn], owner[fqn] = style, i
        before = self.matches(model)
        tp_plan = {**before, **self.param_matches(model)}
        for fqn, style in wanted.items():
            tp_plan.pop(fqn, None)
            if style is not None:
                tp_plan[fqn] = style
        # For the regions, a module an edit took out of the plan while giving styles inside it (a wrapper around a
        # planned layer) still counts as that one layer with its former style: the region is the block holding
        # the layer, not the wrapper. A module taken out with nothing inside (claimed) no longer counts.
        removed = [fqn for fqn, style in wanted.items() if style is None and fqn in before]
        view = {}
        for fqn, style in _expand(tp_plan, (f for f, _ in model.named_modules())).items():
            wrapper = next((r for r in removed if fqn.startswith(r + ".")), None)
            view[wrapper or fqn] = before[wrapper] if wrapper else style
        opening = {n for n, factory in styles.items() if getattr(factory, "opens_region", False)}
        return dataclasses.replace(self, tp_plan=tp_plan, styles=styles, views=views,
                                   regions=tp_regions(view, self.layers, opening))

    def whole_output_styles(self) -> set[str]:
        """The styles whose module hands its output back whole on every TP rank inside a region: tensor-parallel
        experts (summed inside), and a plugin's ``opens_region`` styles."""
        return EXPERTS | {n for n, factory in self.styles.items() if getattr(factory, "opens_region", False)}

    def view_of(self, fqn: str) -> str | None:
        """The mesh view of the module ``fqn`` (or of a parameter's module), from the innermost module the plan
        puts in one; None: the layout's own mesh."""
        while True:
            if fqn in self.views:
                return self.views[fqn]
            if not fqn:
                return None
            fqn = fqn.rpartition(".")[0]

    def causal_lm(self, model: nn.Module) -> nn.Module:
        """The causal LM this plan was made for: ``model`` itself, or the one a wrapper holds (for the checks
        that rebuild the architecture on the meta device)."""
        return model.get_submodule(self.root) if self.root else model

    def matches(self, model: nn.Module) -> dict[str, str]:
        """Expand the wildcard plan against the model's modules: {module FQN: style name}."""
        return _expand(self.tp_plan, (fqn for fqn, _ in model.named_modules()))

    def styles_module(self, model: nn.Module, fqn: str) -> bool:
        """Whether ``model`` has the module ``fqn`` and the plan gives it a style (``matches`` for one name, without
        walking the model)."""
        try:
            model.get_submodule(fqn)
        except AttributeError:
            return False
        return bool(_expand(self.tp_plan, (fqn,)))

    def param_matches(self, model: nn.Module) -> dict[str, str]:
        """The plan entries that name parameters: {parameter FQN: style name}."""
        return _expand(self.tp_plan, (fqn for fqn, _ in model.named_parameters(remove_duplicate=False)))


def layers_present(model: nn.Module, plan: "ModelPlan | None") -> list[str]:
    """The decoder layers present in ``model`` (a pipeline stage holds only some: the others are placeholders
    under the same names, so layers are recognized by their class, the causal LM's "no split" modules, found
    through a wrapper such as PEFT's), in the plan's order."""
    causal_lm = plan.causal_lm(model) if plan is not None else model
    names = set(getattr(causal_lm, "_no_split_modules", None) or [])
    present = {fqn for fqn, m in model.named_modules() if type(m).__name__ in names}
    if plan is not None and plan.layers:
        return [fqn for fqn in plan.layers if fqn in present]
    return [fqn for fqn, _ in model.named_modules() if fqn in present]


def _expand(plan: dict[str, str], names) -> dict[str, str]:
    """{name: style of the last entry of ``plan`` that names it, exactly or as a wildcard}. An edited plan holds
    exact names (tens of thousands for a model of 256 experts per layer): those are looked up, and only the
    wildcards are matched, so the cost grows with names x wildcards, not names x entries."""
    styles = list(plan.values())
    exact = {pattern: i for i, pattern in enumerate(plan) if not _WILDCARD.search(pattern)}
    wild = [(i, re.compile(fnmatch.translate(pattern)).match) for i, pattern in enumerate(plan)
            if _WILDCARD.search(pattern)][::-1]
    out: dict[str, str] = {}
    for fqn in names:
        best = exact.get(fqn, -1)
        for i, match in wild:  # last entry first: the first that matches is the last in the plan
            if i < best:
                break
            if match(fqn):
                best = i
                break
        if best >= 0:
            out[fqn] = styles[best]
    return out


_WILDCARD = re.compile(r"[*?\[]")


def _fqn_of(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    for fqn, mod in model.named_modules():
        if mod is target:
            return fqn
    return None


def hf_plan_from_model(model: nn.Module, tp_plan: dict[str, str]) -> ModelPlan:
    """Derive layers, TP regions, embedding and head of a Hugging Face decoder from its module tree.

    ``tp_plan`` is the full-FQN plan. Regions are the outermost parents, inside decoder layers, of the modules
    that take a replicated input and shard it (column-parallel layers, tensor-parallel experts): attention, MLP,
    MoE blocks. Under sequence parallel their input is all-gathered over the sequence; everything else in a
    layer sees this rank's sequence shard.
    """
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [fqn for fqn, m in model.named_modules() if type(m).__name__ in block_names]
    regions = tp_regions(ModelPlan(tp_plan=tp_plan, layers=layers).matches(model), layers)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = bool(embed is not None and head is not None and head.weight is embed.weight)
    return ModelPlan(tp_plan=tp_plan, layers=layers, regions=regions,
                     embedding=_fqn_of(model, embed), lm_head=_fqn_of(model, head), tied=tied)


def tp_regions(matched: dict[str, str], layers: list[str], opening=()) -> list[str]:
    """The TP regions of a plan's matched modules ({FQN: style}): see ``hf_plan_from_model``; ``opening``: more
    style names that open a region (``ModelPlan.whole_output_styles``)."""
    parents = {fqn.rsplit(".", 1)[0] for fqn, style in matched.items()
               if (style in COLWISE or style in EXPERTS or style in opening or "colwise" in style)
               and any(fqn.startswith(layer + ".") for layer in layers)}
    parents = {p for p in parents if p not in layers}
    return sorted((p for p in parents if not any(p.startswith(q + ".") for q in parents)), key=_natural)


def region_holding(fqn: str, regions) -> str | None:
    """The region (a member of ``regions``) that holds module ``fqn``: the nearest of its ancestors' names
    (regions do not nest), found in O(depth) rather than by matching every region."""
    while "." in fqn:
        fqn = fqn.rpartition(".")[0]
        if fqn in regions:
            return fqn
    return None


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]

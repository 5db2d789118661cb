"""The parameter inventory an estimate starts from: every parameter of a model (real or on the meta device) as a
``ParamRecord`` (where it sits, its share of a mixture of experts' tokens, the bytes it is held in), and the
adapter factors a PEFT method adds, shaped by the library that owns the method (``WrapperLibrary.adapter_factors``,
asked of the registry ``pm``'s libraries). The dimensions cut copies of it as the cost chain runs
(``interface.estimates`` holds the value types)."""
from __future__ import annotations

import re

from ..interface.config import ConfigError
from ..interface.estimates import QUANTIZED_BYTES, Adapters, ParamRecord
from ..interface.moe_config import expert_share

_INVENTORIES: dict = {}


def inventory(model, plan=None, adapters=None, *, pm) -> list[ParamRecord]:
    """Fresh records of ``model``'s parameters (built once per model, plan and adapters; the dimensions cut the
    copies). ``adapters``: an ``Adapters`` to add as PEFT would (``with_adapters``)."""
    key = (id(model), None if plan is None else (tuple(plan.layers), tuple(sorted(plan.views.items()))), adapters)
    if key not in _INVENTORIES or _INVENTORIES[key][0] is not model:
        records = _build_inventory(model, plan, pm)
        _INVENTORIES[key] = (model, records if adapters is None else with_adapters(records, model, adapters, pm))
    return [r.clone() for r in _INVENTORIES[key][1]]


def _build_inventory(model, plan, pm) -> list[ParamRecord]:
    """Every parameter of ``model`` (real or on the meta device) as a ``ParamRecord``: before, in or after the
    decoder layers, and the MoE active share; a PEFT model's adapters tagged (``_adapter_tags``). (Tensor parallel
    fills in the dims it shards from ``plan``.)"""
    layers, before = _layer_list(model, plan)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    # tied by identity: the embedding's weight also held under another name (a head PEFT wrapped in a trained copy
    # keeps the tied original beside it, which the wrapper's own weight does not show)
    embed_weight = getattr(embed, "weight", None)
    tied = embed_weight is not None and sum(p is embed_weight for _, p in
                                            model.named_parameters(remove_duplicate=False)) > 1
    active = expert_share(model.config)
    names = {id(p): n for n, p in model.named_parameters()}
    tags = _adapter_tags(model, pm)
    # trainable parameters of several dtypes (a bf16 head copy beside fp32 adapters): each is held, with its
    # gradient and optimizer state, in its own dtype, which the layout's precision profile cannot say
    mixed = len({p.dtype for p in model.parameters() if p.requires_grad}) > 1
    records = []
    for name, param in model.named_parameters():
        part, layer = _place(name, layers, before)
        is_expert = ".experts." in name or name.endswith(".experts")
        lookup = bool(embed is not None and not tied and param is getattr(embed, "weight", None))
        records.append(ParamRecord(name, tuple(param.shape), part, layer,
                                   tied_head=bool(tied and param is embed.weight),
                                   active=active if is_expert else 1.0, trainable=param.requires_grad,
                                   lookup=lookup, held_bytes=_held_bytes(param, mixed),
                                   view=(plan.view_of(name.rpartition(".")[0]) or "") if plan is not None else "",
                                   **tags.get(name, {})))
    share = {r.name: r.active for r in records}
    for r in records:  # an adapter factor runs on the tokens its weight runs on
        if r.adapter:
            r.active = share.get(r.adapter_of, r.active)
    return records


def _held_bytes(param, mixed: bool) -> float:
    """The element size of a parameter the layout's precision does not decide: a frozen one held in another
    dtype than fp32 (a PEFT model's bf16 base), or a trainable one beside trainable ones of other dtypes; a tensor
    subclass holding its values in inner tensors (torchao's NF4Tensor: a quantized base, on the meta device too)
    takes their bytes per element."""
    import torch
    from torch.distributed.tensor import DTensor

    flatten = getattr(param, "__tensor_flatten__", None)
    if flatten is not None and not isinstance(param, DTensor) and not param.requires_grad and param.numel():
        inner = [getattr(param, name) for name in flatten()[0]]
        return sum(t.numel() * t.element_size() for t in inner) / param.numel()
    if not param.is_floating_point() or param.dtype == torch.float32 or (param.requires_grad and not mixed):
        return 0
    return param.element_size()


def _place(name: str, layers: str | None, before: list[str]) -> tuple[str, int | None]:
    m = re.match(re.escape(layers) + r"\.(\d+)\.", name) if layers else None
    if m:
        return "layer", int(m.group(1))
    if any(name.startswith(p + ".") for p in before):
        return "pre", None
    return "post", None


def _adapter_tags(model, pm) -> dict:
    """{parameter name: ParamRecord fields} of the adapter factors ``model`` holds (a PEFT model's LoRA factors), as
    the library that owns them reads them (``WrapperLibrary.adapter_factors`` with no adapters asked)."""
    return {f.name: dict(adapter=f.adapter, adapter_of=f.adapter_of, rank=f.rank, merged=f.merged)
            for f in _adapter_factors(model, None, pm)}


def _adapter_factors(model, adapters, pm) -> list:
    """Every library's factors ``model`` holds (``adapters`` None), or the first library's that prices
    ``adapters``' method (none: refused)."""
    answers = (library.adapter_factors(model, adapters) for library in pm.wrapper_libraries())
    answers = [answer for answer in answers if answer is not None]
    if adapters is None:  # every library's factors the model holds
        return [f for answer in answers for f in answer]
    if not answers:
        raise ConfigError(f"adapters {adapters.method!r}: no installed plugin prices them. Fix: use lora")
    return answers[0]  # the first library that prices the method


def _layer_list(model, plan) -> tuple[str | None, list[str]]:
    """(FQN of the decoder layers' ModuleList, FQNs of the modules that run before it): the plan's layers, else
    the ModuleList holding most parameters; "before" are the siblings registered ahead of it (embeddings)."""
    from torch import nn

    fqn = None
    if plan is not None and plan.layers:
        fqn = plan.layers[0].rpartition(".")[0]
    else:
        lists = [(f, m) for f, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if lists:
            fqn = max(lists, key=lambda x: sum(p.numel() for p in x[1].parameters()))[0]
    if not fqn:
        return None, []
    parent_fqn, _, leaf = fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    before = []
    for name, _ in parent.named_children():
        if name == leaf:
            break
        before.append(f"{parent_fqn}.{name}" if parent_fqn else name)
    return fqn, before


# ---- adapters on a model that has none ------------------------------------------------------------------
def with_adapters(records: list[ParamRecord], model, adapters: Adapters, pm) -> list[ParamRecord]:
    """``records`` of a model without adapters, frozen, each targeted one followed by the factors ``adapters`` add
    to it, as the library that owns the method shapes them (``WrapperLibrary.adapter_factors``)."""
    if any(r.adapter or not r.trainable for r in records):
        raise ConfigError("adapters asked for a model that has some already (a PEFT model, or frozen parameters). "
                          "Fix: estimate that model as it is, without adapters=")
    factors: dict = {}
    for f in _adapter_factors(model, adapters, pm):
        factors.setdefault(f.adapter_of, []).append(f)
    out = []
    for rec in records:
        base = rec.clone()
        base.trainable = False
        out.append(base)
        for f in factors.get(rec.name, ()):
            out.append(ParamRecord(f.name, f.shape, rec.part, rec.layer, active=rec.active, adapter=f.adapter,
                                   adapter_of=rec.name, rank=f.rank, merged=f.merged))
    return out


_ADAPTED: dict = {}


def adapted_inventory(records: list[ParamRecord], model, adapters: Adapters, pm) -> list[ParamRecord]:
    """``records`` (fresh, as ``inventory`` gives them) with ``adapters``: the factors come from one cached
    template per model and adapters; the records keep what the caller gave them."""
    key = (id(model), adapters)
    if key not in _ADAPTED or _ADAPTED[key][0] is not model:
        _ADAPTED[key] = (model, with_adapters(records, model, adapters, pm))
    by_name = {r.name: r for r in records}
    adapted = {t.adapter_of for t in _ADAPTED[key][1] if t.adapter}
    out = []
    for t in _ADAPTED[key][1]:
        if t.adapter:  # placed with its weight as this inventory places it
            base = by_name[t.adapter_of]
            twin = t.clone()
            twin.part, twin.layer, twin.active = base.part, base.layer, base.active
            out.append(twin)
        elif t.name in by_name:
            by_name[t.name].trainable = False
            if adapters.quantized and t.name in adapted and len(by_name[t.name].shape) == 2:  # QLoRA's 4-bit base
                by_name[t.name].held_bytes = QUANTIZED_BYTES[adapters.quantized]
            elif by_name[t.name].held_bytes == 0 and adapters.base_bytes != 4:  # the frozen base in its own dtype
                by_name[t.name].held_bytes = adapters.base_bytes
            out.append(by_name[t.name])
    if len(out) != len(records) + sum(1 for t in _ADAPTED[key][1] if t.adapter):
        raise ValueError("adapters: the inventory does not list the model's parameters")
    return out

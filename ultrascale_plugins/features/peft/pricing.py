"""What LoRA adds to a model, for the estimates: the factors of a PEFT model's LoRA layers, read from the model, and
the factors ``peft.get_peft_model(model, LoraConfig(r=r, target_modules=target))`` would add to a model that has
none (the planner's ``--peft lora``), with their shapes, as the installed peft builds them. Both asked of PEFT's
``WrapperLibrary`` (``wrapper.PeftLibrary.adapter_factors``); the estimates build the parameter records from them
(``interface.estimates``)."""
from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ...interface.estimates import AdapterFactor
from ...interface.fields import ConfigError
from ...interface.meta_copy import meta_copy


def adapter_factors(model, adapters) -> list[AdapterFactor] | None:
    """The LoRA factors ``model`` holds (``adapters`` None), or those a LoRA ``adapters`` would add to it (cached per
    model and adapters); None when it holds none, or for another method."""
    if adapters is None:
        return held_factors(model) or None
    if adapters.method != "lora":
        return None
    key = (id(model), adapters)  # peft builds its model once per model and adapters
    if key not in _PRICED or _PRICED[key][0] is not model:
        _PRICED[key] = (model, priced_factors(model, adapters))
    return list(_PRICED[key][1])


_PRICED: dict = {}


def held_factors(model) -> list[AdapterFactor]:
    """The LoRA factors of a PEFT model (found by PEFT's attributes, so peft need not be imported): what each
    adapts, its rank, and whether PEFT merges it (``ParamWrapper``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [AdapterFactor(names[id(param)], kind, names[id(base)], rank, merged)
            for kind, param, base, rank, merged in _lora_factors(model) if id(base) in names]


def _lora_factors(model):
    """(kind, factor parameter, adapted parameter, rank, merged) of each LoRA factor ``model`` holds."""
    for _, module in model.named_modules():
        ranks = getattr(module, "r", None)
        if not isinstance(ranks, dict) or not hasattr(module, "base_layer") or not hasattr(module, "lora_A"):
            continue
        merged = type(module).__name__ == "ParamWrapper"
        base = module.get_param() if merged else getattr(module.get_base_layer(), "weight", None)
        if base is None:
            continue
        for kind in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            for adapter, factor in getattr(module, kind, {}).items():
                param = factor if isinstance(factor, nn.Parameter) else getattr(factor, "weight", None)
                if param is not None:
                    yield kind, param, base, int(ranks.get(adapter, 0)), merged


def priced_factors(model, adapters) -> list[AdapterFactor]:
    """The LoRA factors ``peft.get_peft_model(model, LoraConfig(r=r, target_modules=target))`` adds, with their
    shapes, asked of the installed peft itself on a meta-device copy of ``model``: which layers a target names,
    and how a mixture of experts' fused weights are adapted (peft's transformers-5 conversion, which changes from
    one peft release to the next), are peft's to say. The names are the plain model's."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        from ...interface.extras import install_command

        raise ConfigError(f"LoRA pricing asks peft which layers it adapts, and peft is not installed. "
                          f"Fix: {install_command('peft')}") from None
    twin = meta_copy(model)  # for peft to wrap: the same tree and names, no storage
    plain = {id(p): n for n, p in twin.named_parameters()}
    target = adapters.target if isinstance(adapters.target, str) else list(adapters.target)
    try:
        # on the meta device, as the copy is: peft's adapters get no storage and no initialization
        with warnings.catch_warnings(), torch.device("meta"):  # peft's notes to a user (GPT-2's Conv1D, ...)
            warnings.simplefilter("ignore")
            wrapped = get_peft_model(twin, LoraConfig(r=adapters.r, lora_alpha=2 * adapters.r, target_modules=target))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError(_refusal(model, adapters, exc)) from None
    out = []
    for kind, param, base, rank, merged in _lora_factors(wrapped):
        if id(base) not in plain:
            continue
        base_name = plain[id(base)]
        owner = base_name.rpartition(".")[0] if not merged else base_name
        suffix = f".{kind}.default" + ("" if kind.startswith("lora_embedding") else ".weight")
        out.append(AdapterFactor(owner + suffix, kind, base_name, rank, merged, tuple(param.shape)))
    if not out:
        raise ConfigError(_no_match(model, adapters))
    return out


def _no_match(model, adapters) -> str:
    return (f"LoRA targets {adapters.target!r} match no layer of this {model.config.model_type} model. "
            "Fix: 'all-linear', or names of its linear layers (e.g. q_proj,v_proj)")


def _refusal(model, adapters, exc) -> str:
    """One line for what peft refused: a named module LoRA does not adapt, a target that matches nothing, or
    peft's own first sentence."""
    if "not supported" in str(exc) and not isinstance(adapters.target, str):
        for fqn, m in model.named_modules():
            if fqn and any(fqn == k or fqn.endswith("." + k) for k in adapters.target) \
                    and not isinstance(m, (nn.Linear, Conv1D, nn.Embedding)):
                return (f"LoRA target '{fqn}' is a {type(m).__name__}, which LoRA does not adapt. "
                        "Fix: name linear or embedding layers (e.g. q_proj,v_proj), or 'all-linear'")
    if "not found" in str(exc) or "did not match" in str(exc):
        return _no_match(model, adapters)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"LoRA r={adapters.r} on {adapters.target!r}: peft refuses it: {first[:300]} "
            "Fix: change --lora-target (e.g. 'all-linear', or q_proj,v_proj)")

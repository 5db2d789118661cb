"""What LoRA adds to a model, for the estimates: the factors of a PEFT model's LoRA layers, read from the model, and
the factors ``peft.get_peft_model(model, LoraConfig(r=r, target_modules=target))`` (peft 0.21, transformers 5)
would add to a model that has none (the planner's ``--peft lora``), with their shapes. Both through
``ultrascale_adapter_factors``; the estimates build the parameter records from them (``interface.estimates``)."""
from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from ...interface.estimates import AdapterFactor
from ...interface.fields import ConfigError
from ...interface.hookspecs import hookimpl


@hookimpl
def ultrascale_adapter_factors(model, adapters):
    if adapters is None:
        return held_factors(model) or None
    if adapters.method != "lora":
        return None
    return priced_factors(model, adapters)


def held_factors(model) -> list[AdapterFactor]:
    """The LoRA factors of a PEFT model (found by PEFT's attributes, so peft need not be imported): what each
    adapts, its rank, and whether PEFT merges it (``ParamWrapper``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for _, module in model.named_modules():
        ranks = getattr(module, "r", None)
        if not isinstance(ranks, dict) or not hasattr(module, "base_layer") or not hasattr(module, "lora_A"):
            continue
        merged = type(module).__name__ == "ParamWrapper"
        base = module.get_param() if merged else getattr(module.get_base_layer(), "weight", None)
        if base is None or id(base) not in names:
            continue
        for kind in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            for adapter, factor in getattr(module, kind, {}).items():
                param = factor if isinstance(factor, nn.Parameter) else getattr(factor, "weight", None)
                if param is not None and id(param) in names:
                    out.append(AdapterFactor(names[id(param)], kind, names[id(base)], int(ranks.get(adapter, 0)),
                                             merged))
    return out


# What peft 0.21 targets in a mixture of experts whose experts transformers 5 fuses into 3-D parameters
# (``peft.utils.transformers_weight_conversion``: ``_MOE_TARGET_MODULE_MAPPING`` and ``_MOE_FUSED_TARGETS``): the
# names the linear layers had before (transformers 4) become targeted parameters, and a fused parameter takes the
# ranks of the layers fused into it. "all-linear" names them all, so the experts and the router train too.
_MOE_TARGETS = {
    "mixtral": ({"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
                {"gate_up_proj": ("w1", "w3")}),
    "qwen2_moe": ({"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                   "down_proj": "down_proj"}, {"gate_up_proj": ("gate_proj", "up_proj")}),
}


def _moe_pattern(model_type: str):
    """Which of ``_MOE_TARGETS`` peft applies to ``model_type`` (transformers' conversion table, as peft reads it;
    peft adds mixtral), or None."""
    if model_type == "mixtral":
        return _MOE_TARGETS["mixtral"]
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN
    except ImportError:  # transformers 4: experts are linear layers, targeted as such
        return None
    return _MOE_TARGETS.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type))


def _matches(name: str, keys) -> bool:
    return any(name == k or name.endswith("." + k) for k in keys)


def lora_targets(model, adapters) -> tuple[list, list]:
    """(modules, parameters) PEFT adapts: [(FQN, module)] of linear, Conv1D and embedding layers, and [(FQN of the
    module holding it, parameter name, rank)] of parameters targeted directly (a mixture of experts' fused weights
    and router: ``_MOE_TARGETS``)."""
    named = list(model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    r = adapters.r
    if adapters.target == "all-linear":
        keys = {fqn for fqn, m in named if isinstance(m, (nn.Linear, Conv1D)) and m is not head}
    else:
        keys = set(adapters.target)
    params: dict = {}
    pattern = _moe_pattern(getattr(model.config, "model_type", ""))
    if pattern is not None:
        mapping, fused = pattern
        if adapters.target == "all-linear":
            keys = {k.rpartition(".")[2] for k in keys} | set(mapping)
        renamed = {}
        for key in keys:
            old = next((o for o in mapping if key == o or key.endswith("." + o)), None)
            if old is not None:
                renamed[key] = old
        for new, parts in fused.items():
            present = {old for old in renamed.values() if mapping[old] == new}
            if 0 < len(present) < len(parts):
                raise ConfigError(f"LoRA targets {', '.join(sorted(present))} without "
                                  f"{', '.join(sorted(set(parts) - present))}: PEFT refuses it, since transformers "
                                  f"fuses them into {new}. Fix: target all of {', '.join(parts)}, or none")
        for old in renamed.values():
            new = mapping[old]
            params[new] = r * (len(fused[new]) if new in fused else 1)
        keys -= set(renamed)
    modules = [(fqn, m) for fqn, m in named if fqn and _matches(fqn, keys)]
    odd = [(fqn, m) for fqn, m in modules if not isinstance(m, (nn.Linear, Conv1D, nn.Embedding))]
    if odd and adapters.target != "all-linear":
        raise ConfigError(f"LoRA target '{odd[0][0]}' is a {type(odd[0][1]).__name__}, which LoRA does not adapt. "
                          "Fix: name linear or embedding layers (e.g. q_proj,v_proj), or 'all-linear'")
    modules = [(fqn, m) for fqn, m in modules if (fqn, m) not in odd]
    wrapped = []
    for fqn, m in named:
        for pname, p in m.named_parameters(recurse=False):
            key = f"{fqn}.{pname}" if fqn else pname
            rank = next((params[t] for t in sorted(params) if key == t or key.endswith("." + t)), None)
            if rank is not None and p.ndim in (2, 3):
                wrapped.append((fqn, pname, rank))
    if not modules and not wrapped:
        raise ConfigError(f"LoRA targets {adapters.target!r} match no layer of this {model.config.model_type} "
                          "model. Fix: 'all-linear', or names of its linear layers (e.g. q_proj,v_proj)")
    return modules, wrapped


def priced_factors(model, adapters) -> list[AdapterFactor]:
    """The LoRA factors PEFT would add, with their shapes: A (r, in) and B (out, r) for a linear layer (a Conv1D
    holds its weight as (in, out)); A (r, embeddings) and B (embedding width, r) for an embedding; for a parameter
    targeted directly, (r*E, in) and (out, r*E) over its E experts (one for a 2-D weight), merged."""
    modules, wrapped = lora_targets(model, adapters)
    names = {id(p): n for n, p in model.named_parameters()}
    r = adapters.r
    out = []
    for fqn, m in modules:
        weight = names[id(m.weight)]
        if isinstance(m, nn.Embedding):
            n_in, n_out = m.weight.shape
            out += [AdapterFactor(f"{fqn}.lora_embedding_A.default", "lora_embedding_A", weight, r, False, (r, n_in)),
                    AdapterFactor(f"{fqn}.lora_embedding_B.default", "lora_embedding_B", weight, r, False, (n_out, r))]
        else:
            n_in, n_out = m.weight.shape if isinstance(m, Conv1D) else m.weight.shape[::-1]
            out += [AdapterFactor(f"{fqn}.lora_A.default.weight", "lora_A", weight, r, False, (r, n_in)),
                    AdapterFactor(f"{fqn}.lora_B.default.weight", "lora_B", weight, r, False, (n_out, r))]
    for fqn, pname, rank in wrapped:
        module = model.get_submodule(fqn) if fqn else model
        param = getattr(module, pname)
        if param.ndim == 3:  # (experts, out, in), or (experts, in, out) where the module says it is transposed
            experts, n_out, n_in = param.shape
            if getattr(module, "is_transposed", False):
                n_in, n_out = n_out, n_in
        else:
            experts, (n_out, n_in) = 1, param.shape
        base = names[id(param)]
        out += [AdapterFactor(f"{base}.lora_A.default.weight", "lora_A", base, rank, True, (rank * experts, n_in)),
                AdapterFactor(f"{base}.lora_B.default.weight", "lora_B", base, rank, True, (n_out, rank * experts))]
    return out

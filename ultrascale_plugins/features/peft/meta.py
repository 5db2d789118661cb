"""PEFT models built on the meta device: which pretrained tensor each entry starts from, and PEFT's own
initialization of the adapters, drawn shard by shard like the rest of the model.

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DIR))
        model = get_peft_model(base, LoraConfig(r=16, target_modules="all-linear"))
    pmodel = parallelize(model, ParallelConfig(dp_shard=-1), init_from=DIR)

- **Names** (``PeftWrapper.pretrained_name``): PEFT replaces each targeted layer by a LoRA layer holding the original
  as ``base_layer`` (``q_proj.weight`` becomes ``q_proj.base_layer.weight``) beside its adapters, and keeps a
  ``modules_to_save`` module twice (``lm_head.original_module`` and the trained copy
  ``lm_head.modules_to_save.<adapter>``, both starting from ``lm_head``); the pretrained files, and the seeds of a
  model initialized from scratch, name the plain causal LM's modules. The adapters (``lora_A``, ``lora_B``,
  ``lora_embedding_A`` / ``_B``, ``lora_magnitude_vector``) are this plugin's: no file holds them.
- **Adapters** (``PeftWrapper.init_module``): what PEFT does when it builds a LoRA layer, in its order — the adapter
  modules' construction (``nn.Linear``'s ``reset_parameters``, ``torch.randn`` for the embedding's) then the layer's
  ``reset_lora_parameters``: kaiming-uniform A and zero B (``init_lora_weights=True``), normal A
  (``"gaussian"``), or the construction's values (``False``); LoRA on an embedding: zero A, normal B. rsLoRA's
  scaling is the config's, nothing to draw.
- **DoRA's magnitude** (``PeftWrapper.init_dependent``): the norm of the base weight plus the adapter's update,
  computed by PEFT's own DoRA layer once the base holds its values — one layer at a time, its shards gathered.

The engine seeds each unit's draws by (seed, its name): an adapter by its name in the PEFT model
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default``), a base module by its name in the plain
model, so the base of a PEFT model initialized from scratch is the plain model's for the same seed. The adapters
are PEFT's scheme but not the numbers ``get_peft_model`` draws from the global generator on a real model;
``initialize.init_introduced(model, seed)`` gives a PEFT model built in one process the engine's values.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from ...interface.fields import ConfigError
from ...interface.hookspecs import hookimpl
from .adapters import is_peft_model

INTRODUCED = ""  # pretrained_name's answer for an entry no pretrained file holds
NEW = object()  # plain_names' mark of a module the adapters introduced
SUPPORTED_INITS = (True, False, "gaussian")  # the schemes reset_lora_parameters draws without the base's values
_names: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # plain_names, per model


def _wrapper_classes():
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # pragma: no cover - older peft
        from peft.utils import ModulesToSaveWrapper
    return BaseTunerLayer, ModulesToSaveWrapper


def plain_names(model) -> dict[str, object]:
    """{module name in ``model``: its name in the plain causal LM, ``NEW`` for a module this plugin's adapters
    introduced, None outside the causal LM} for a PEFT model, computed once per model. A LoRA layer's
    ``base_layer`` is the module the layer replaced and its other children (``lora_A``, ``lora_B``, ...) are new;
    a ``modules_to_save`` wrapper's ``original_module`` and each trained copy are the module it wraps. Kept
    until an adapter is added or removed."""
    key = tuple(model.peft_config)
    cached = _names.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    tuner_layer, saved_wrapper = _wrapper_classes()
    inner = model.get_base_model()
    out: dict[str, object] = {}

    def visit(module: nn.Module, name: str, plain) -> None:
        out[name] = plain
        for child_name, child in module.named_children():
            if child is inner:
                child_plain = ""
            elif plain is None or plain is NEW:
                child_plain = plain
            elif isinstance(plain, _Copies):  # one trained copy per adapter, each starting from the module
                child_plain = plain.of
            elif isinstance(module, tuner_layer):
                child_plain = plain if child_name == "base_layer" else NEW
            elif isinstance(module, saved_wrapper):
                child_plain = (plain if child_name == "original_module" else
                               _Copies(plain) if child_name == "modules_to_save" else NEW)
            else:
                child_plain = f"{plain}.{child_name}" if plain else child_name
            visit(child, f"{name}.{child_name}" if name else child_name, child_plain)

    visit(model, "", None)
    _names[model] = (key, out)
    return out


class _Copies:
    """A ``modules_to_save`` dictionary: its entries are copies of the module named ``of``."""

    def __init__(self, of: str):
        self.of = of


def entry_plain_name(model, name: str):
    module_name, _, entry = name.rpartition(".")
    plain = plain_names(model).get(module_name)
    if plain is NEW:
        return INTRODUCED
    if not isinstance(plain, str):
        return None
    return f"{plain}.{entry}" if plain else entry


def _introduced(model, name: str) -> bool:
    return plain_names(model).get(name) is NEW


def init_module(model, name, module) -> bool:
    """PEFT's initialization of ``module`` when it is a LoRA layer or one of the modules its adapters introduced."""
    from peft.tuners.lora import LoraLayer

    if isinstance(module, LoraLayer):  # PEFT's reset after construction, for each adapter this layer holds
        for adapter in [*module.lora_A.keys(), *module.lora_embedding_A.keys()]:
            module.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)
        return True
    if not _introduced(model, name):
        return False
    # an adapter module: its construction's values (PEFT then resets them in the layer above)
    if isinstance(module, nn.ParameterDict):  # lora_embedding_A / _B: torch.randn at construction
        for p in module.values():
            nn.init.normal_(p)
    elif hasattr(module, "reset_parameters"):  # lora_A / lora_B: nn.Linear (or a convolution)
        module.reset_parameters()
    else:  # DoRA's magnitude: set from the base weight's values (PeftWrapper.init_dependent)
        for p in module.parameters(recurse=False):
            nn.init.zeros_(p)
    return True


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def init_dependent(modules) -> None:
    """DoRA's magnitude of every LoRA layer in ``modules``, from its base weight and adapters."""
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for part in modules:
            for module in part.modules():
                if isinstance(module, LoraLayer):
                    for adapter, magnitude in module.lora_magnitude_vector.items():
                        _set_magnitude(module, adapter, magnitude)


def _set_magnitude(layer, adapter: str, magnitude: nn.Module) -> None:
    """DoRA's magnitude as PEFT's own DoRA layer computes it at construction (``update_layer``: the column norms of
    the base weight plus scaling x B @ A), from the whole base weight and adapters (gathered from their shards), with
    this rank's part written into the sharded magnitude."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    base = nn.Module()  # the base layer as update_layer reads it: .weight (and .parameters())
    base.weight = nn.Parameter(_whole(layer.get_base_layer().weight), requires_grad=False)
    if adapter in layer.lora_A:
        lora_a, lora_b = _whole(layer.lora_A[adapter].weight), _whole(layer.lora_B[adapter].weight)
    else:
        lora_a, lora_b = _whole(layer.lora_embedding_A[adapter]), _whole(layer.lora_embedding_B[adapter])
    fresh = type(magnitude)(fan_in_fan_out=magnitude.fan_in_fan_out)
    fresh.update_layer(base_layer=base, lora_A=lora_a, lora_B=lora_b, scaling=layer.scaling[adapter])
    value = fresh.weight.detach()
    target = magnitude.weight
    if isinstance(target, DTensor):
        target.to_local().copy_(distribute_tensor(value.to(target.device), target.device_mesh, target.placements,
                                                  src_data_rank=None).to_local())
    else:
        target.copy_(value.to(target.device))


@hookimpl
def ultrascale_validate_model(model, plan, config):
    """A PEFT model on the meta device gets its adapters from ``PeftWrapper.init_module``: refuse, before any process
    group, what that does not draw (adapters whose initial values depend on the base's, other tuners)."""
    if not is_peft_model(model) or not any(p.is_meta for p in model.parameters()):
        return
    fix = ("Fix: load the base model with its weights (from_pretrained) and call get_peft_model on it before "
           "parallelize, or use LoRA with init_lora_weights True, False or \"gaussian\"")
    for adapter, peft_config in model.peft_config.items():
        kind = getattr(getattr(peft_config, "peft_type", None), "value", peft_config.peft_type)
        if str(kind).upper() != "LORA":
            raise ConfigError(f"a {kind} PEFT model (adapter '{adapter}') built on the meta device: only LoRA "
                              f"adapters (and DoRA) get their initialization on the meta device. {fix}")
        init = peft_config.init_lora_weights
        if init not in SUPPORTED_INITS:
            raise ConfigError(f"LoraConfig(init_lora_weights={init!r}) (adapter '{adapter}') on a PEFT model built "
                              "on the meta device: that initialization is computed from the base weights, which "
                              f"are not loaded when the adapters are made. {fix}")
        if getattr(peft_config, "trainable_token_indices", None):
            raise ConfigError(f"LoraConfig(trainable_token_indices=...) (adapter '{adapter}') on a PEFT model built "
                              f"on the meta device is not supported. {fix}")
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for adapter, variant in getattr(module, "lora_variant", {}).items():
                if not type(variant).__name__.startswith("Dora"):
                    raise ConfigError(f"{name}: the LoRA variant {type(variant).__name__} (adapter '{adapter}') on a "
                                      "PEFT model built on the meta device is not supported (its initialization "
                                      f"is not drawn by the engine). {fix}")

"""The causal LM built on the meta device: parameters without storage (no rank ever holds the whole model), the
buffers such a build leaves empty (rotary frequencies, embedding scales) computed by the model's own
``_init_weights``, as transformers' ``from_pretrained`` does after its own meta build.

The model's own initialization, one module at a time, is here too (which ``PreTrainedModel``'s ``_init_weights``
owns each module, one module's init under transformers' guard, a seeded CPU generator): the buffers use it here,
``initialize.ModelInit`` uses it for the parameters.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn


def empty_model(model_config, dtype=torch.float32):
    """The causal LM on the meta device (tied weights stay tied) with its weights in ``dtype`` (a PEFT recipe's
    frozen base: bf16), its buffers computed."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    fill_buffers(model)  # the buffers the meta build left empty, from the model's own _init_weights
    return model


def computed_buffers(model_config) -> dict[str, torch.Tensor]:
    """The buffers a model computes at construction (rotary frequencies, ...), for a model built entirely on the
    meta device (``torch.device("meta")``), which leaves them empty."""
    return {name: buf for name, buf in empty_model(model_config).named_buffers()}


def fill_buffers(model: nn.Module) -> None:
    """Give the buffers a meta-device build left empty (rotary frequencies, embedding scales, ...) CPU storage and
    their values, from the model's own ``_init_weights`` — as transformers' ``from_pretrained`` does after building
    on the meta device (its ``_init_weights`` recomputes such buffers: rotary embeddings keep ``original_inv_freq``
    for it). A buffer no ``_init_weights`` sets is zero. Parameters are not touched."""
    owners = init_owners(model)
    with torch.no_grad(), torch.device("cpu"), init_guard(), seeded_cpu_rng(0):
        for name, module in model.named_modules():
            empty = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
            if not empty:
                continue
            for k in empty:
                b = module._buffers[k]
                module._buffers[k] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")
            target = module
            if any(p is not None and not p.is_meta for p in module._parameters.values()):
                # real parameters next to empty buffers: initialize a view of the module whose parameters are
                # meta (writes to them are no-ops) and whose buffers are the module's own
                target = copy.copy(module)
                target._parameters = {k: (None if p is None else nn.Parameter(p.detach().to("meta"), p.requires_grad))
                                      for k, p in module._parameters.items()}
            own_init(owners.get(name), target)


def init_owners(model: nn.Module) -> dict[str, object]:
    """{module name: the ``PreTrainedModel`` whose ``_init_weights`` initializes it}: the nearest one among the
    module and its ancestors — the dispatch of transformers' ``initialize_weights`` (``smart_apply``), which hands
    a composite model's sub-models to their own ``_init_weights``."""
    from transformers import PreTrainedModel

    owners: dict[str, object] = {}

    def visit(module: nn.Module, prefix: str, owner) -> None:
        if isinstance(module, PreTrainedModel):
            owner = module
        owners[prefix] = owner
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name, owner)

    visit(model, "", None)
    return owners


def own_init(owner, module: nn.Module) -> None:
    """The model's own initialization of one module (``owner._init_weights``; a module outside any Hugging Face
    model gets torch's ``reset_parameters``). Not ``_initialize_weights``: its per-module "already initialized"
    flag must not skip a module whose values are being drawn."""
    if owner is not None:
        owner._init_weights(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


@contextlib.contextmanager
def seeded_cpu_rng(seed: int):
    """The global CPU generator (which ``torch.nn.init`` and ``transformers.initialization`` draw from) seeded with
    ``seed`` inside the block, its state restored after. CUDA generators are left alone."""
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


def init_guard():
    """transformers' guard around ``initialize_weights`` (torch's init functions honour ``_is_hf_initialized``)."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # pragma: no cover - older transformers
        return contextlib.nullcontext()
    return guard_torch_init_functions()

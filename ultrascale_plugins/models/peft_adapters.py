"""PEFT models (``peft.get_peft_model``: LoRA, DoRA, ...) handed to ``parallelize``.

A PEFT model wraps the causal LM (``base_model.model``), so this plugin tells the engine where it is
(``ultrascale_wrapped_model``): the plans of the wrapped model then apply through the wrapper, and ZeRO-3 shards
each decoder layer on its own, adapters included, instead of gathering the whole model as one group. The frozen
base has no gradients and no optimizer state: data parallel averages, and ZeRO shards, only what trains.

Not supported yet, and refused before any process group: tensor and pipeline parallel (adapters must be sharded
to follow their base layer's style, and a pipeline must split the wrapped model), and a PEFT model built on the
meta device (its adapters need PEFT's initialization, and pretrained files do not name PEFT's modules).
"""
from __future__ import annotations

import sys

from ..interface.fields import ConfigError, field_error
from ..interface.hookspecs import hookimpl


def is_peft_model(model) -> bool:
    if "peft" not in sys.modules:  # a PEFT model cannot exist without peft imported
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


@hookimpl
def ultrascale_wrapped_model(model):
    if not is_peft_model(model):
        return None
    inner = model.get_base_model()
    prefix = next(fqn for fqn, module in model.named_modules() if module is inner)
    return inner, prefix


@hookimpl
def ultrascale_save_pretrained(pmodel, directory):
    """The adapters in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``), as a PEFT model's
    ``save_pretrained`` writes them: every rank gathers the trainable tensors (the adapters, a ``modules_to_save``
    copy), which are small, never the frozen base; rank 0 hands them to PEFT to name and write."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = pmodel.module
    if not is_peft_model(model):
        return None
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    state = {}
    for part in pmodel.modules:
        for name, tensor in part.state_dict().items():  # the same order on every rank: the gathers pair up
            if name in trainable:
                state[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
    if dist.get_rank() == 0:
        model.save_pretrained(directory, state_dict=state)
    dist.barrier()
    return True


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if not is_peft_model(model):
        return
    if any(p.is_meta for p in model.parameters()):
        # the engine would give the adapters the base model's initialization (a non-zero LoRA B: the run would
        # not start from the base model) and pretrained files do not name PEFT's modules
        raise ConfigError("a PEFT model built on the meta device is not supported yet: its adapters would not get "
                          "PEFT's initialization. Fix: load the base model with its weights (from_pretrained), "
                          "then call get_peft_model")
    _refuse_tensor_parallel(config)
    _refuse_pipeline(config)


def _refuse_tensor_parallel(config) -> None:
    if getattr(config, "tp", 1) > 1:
        raise field_error("tp", config.tp, "a PEFT model under tp > 1 is not supported yet (the adapters would have "
                          "to be sharded like their base layers)", "use tp: 1 with data parallel (ZeRO-1/2/3, HSDP, "
                          "DDP) or context parallel")


def _refuse_pipeline(config) -> None:
    if getattr(config, "pp", 1) > 1:
        raise field_error("pp", config.pp, "a PEFT model under pp > 1 is not supported yet (the pipeline split does "
                          "not reach into the PEFT wrapper)", "use pp: 1 with data parallel (ZeRO-1/2/3, HSDP, "
                          "DDP) or context parallel")

"""PEFT models (``peft.get_peft_model``: LoRA, DoRA, ...) handed to ``parallelize``.

A PEFT model wraps the causal LM (``base_model.model``), so this plugin tells the engine where it is
(``ultrascale_declare_model_wrapper``, ``wrapper.PeftWrapper``): the plans of the wrapped model then apply through the wrapper, and ZeRO-3 shards
each decoder layer on its own, adapters included, instead of gathering the whole model as one group. The frozen
base has no gradients and no optimizer state: data parallel averages, and ZeRO shards, only what trains.

Under tensor parallel each adapter follows its base layer's style (``ultrascale_declare_plan_edit``); what it cannot
follow is refused before any process group (``ultrascale_validate_model``).
"""
from __future__ import annotations

import sys

from torch import nn

from ...interface.facts import layout_facts
from ...interface.fields import ConfigError, field_error
from ...interface.hookspecs import hookimpl


def is_peft_model(model) -> bool:
    if "peft" not in sys.modules:  # a PEFT model cannot exist without peft imported
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def save_adapters(pmodel, directory) -> bool:
    """The adapters in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``), as a PEFT model's
    ``save_pretrained`` writes them: every rank gathers the trainable tensors (the adapters, a ``modules_to_save``
    copy), which are small, never the frozen base; rank 0 hands them to PEFT to name and write."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = pmodel.module
    if not is_peft_model(model):
        return False
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    state = {}
    for part in pmodel.modules:
        for name, tensor in part.state_dict().items():  # the same order on every rank: the gathers pair up
            if name in trainable:
                state[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
    state = pmodel.runtime.gather_full_state(state)  # a pipeline's other stages hold the other layers' adapters
    if dist.get_rank() == 0:
        model.save_pretrained(directory, state_dict=state)
    dist.barrier()
    return True


# The adapter that follows each base-layer style (``lora_B`` after a column-parallel base: its output features are
# the base's; ``lora_A`` before a row-parallel base: its input features are), with the same style; the other
# adapter stays replicated. Column-parallel: x (replicated) -> A -> h (replicated, r features) -> B's shard ->
# this rank's output features, added to the base's; the gradient of h is summed over TP by B's style. Row-parallel:
# this rank's input features -> A's shard -> partial h, summed over TP by A's style -> B (replicated) -> the whole
# output, added to the base's reduced output. A and B hold r features, so the extra communication is r-wide.
# Under sequence parallel a region with two row-parallel layers all-reduces and then slices its output
# (dims.tensor.plugin), so a LoRA-wrapped row-parallel base costs an all-reduce where it cost a reduce-scatter.
_FOLLOWS = {"colwise": "lora_B", "unit_colwise": "lora_B", "colwise_gather_output": "lora_B", "colwise_rep": "lora_B",
            "packed_colwise": "lora_B", "rowwise": "lora_A", "unit_rowwise": "lora_A", "rowwise_split_input": "lora_A",
            "rowwise_rep": "lora_A"}


# Styles that leave the module's weights whole and act on its output (DeepSeek's latent-attention projection: the
# rotary part's gradient summed over TP): they stay on the PEFT layer, so they act on the output with the adapters'
# part added, and the adapters, like the base, stay whole.
_ON_OUTPUT = {"mla_kv_a_proj"}


class _CannotFollow(Exception):
    """An adapter on a module whose tensor-parallel style it cannot follow (the reason)."""


def _adapter_entries(model, fqn: str, module, style: str) -> dict:
    """The plan entries that shard the PEFT layer ``module`` at ``fqn`` as its base layer was to be sharded with
    ``style``; raises ``_CannotFollow``."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    if style in _ON_OUTPUT and isinstance(module, LoraLayer) and isinstance(getattr(module, "base_layer", None),
                                                                           nn.Linear):
        return {}
    entries = {fqn: None}
    if isinstance(module, ModulesToSaveWrapper):  # a trained copy of the module beside the frozen original
        own = {id(p) for p in module.original_module.parameters()}
        shared = [name for name, p in model.named_parameters(remove_duplicate=False)
                  if id(p) in own and not name.startswith(fqn + ".")]
        if shared:
            raise _CannotFollow(f"it is tied to '{shared[0]}' (tied embedding and head), which this version does not "
                                "shard with a trained copy beside it")
        entries[f"{fqn}.original_module"] = style
        entries.update({f"{fqn}.modules_to_save.{name}": style for name in module.modules_to_save})
        return entries
    if not isinstance(module, LoraLayer):
        raise _CannotFollow(f"PEFT's {type(module).__name__} layers are not sharded by this version")
    if any(module.use_dora.values()):
        raise _CannotFollow("DoRA's weight norm needs the whole base weight (its rows under a row-parallel style) and "
                            "reads it outside the forward pass")
    adapters = list(module.lora_A)
    if not adapters or style not in _FOLLOWS or not isinstance(getattr(module, "base_layer", None), nn.Linear):
        raise _CannotFollow(f"its base layer is {type(module.get_base_layer()).__name__} with style '{style}'; "
                            "adapters follow only column- and row-parallel nn.Linear layers")
    entries[f"{fqn}.base_layer"] = style
    entries.update({f"{fqn}.{_FOLLOWS[style]}.{name}": style for name in adapters})
    return entries


def _adapted(model, plan):
    """(FQN, PEFT layer, its base's style) for every PEFT layer the plan gives a style."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper

    for fqn, style in plan.matches(model).items():
        module = model.get_submodule(fqn)
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            yield fqn, module, style


@hookimpl
def ultrascale_declare_plan_edit(model, plan, config):
    """Move each planned module PEFT wrapped onto its base layer (the style would otherwise shard the wrapper,
    adapters included), and shard the adapters to follow it (``_FOLLOWS``). A layer whose style adapters cannot
    follow keeps its entry; ``ultrascale_validate_model`` refuses it under tp > 1."""
    if not is_peft_model(model):
        return None
    from peft.tuners.lora import LoraLayer

    from ...interface.plan_edit import PlanEdit

    entries = {}
    for fqn, module, style in _adapted(model, plan):
        if (style == "embedding_rowwise" and not plan.tied and isinstance(module, LoraLayer)
                and isinstance(module.get_base_layer(), nn.Embedding)):
            # LoRA's embedding factors look tokens up in A's columns, which a vocabulary-parallel base would split
            # among the ranks: an untied embedding with adapters stays whole on every TP rank, its adapters too
            entries[fqn] = None
            continue
        try:
            entries.update(_adapter_entries(model, fqn, module, style))
        except _CannotFollow:
            continue
    return PlanEdit(entries)


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if not is_peft_model(model):
        return
    facts = layout_facts(config)
    if facts.degree("tp") > 1 and plan is not None:
        _check_tensor_parallel(model, plan, facts)


def _check_tensor_parallel(model, plan, facts) -> None:
    """Under tp > 1 every adapter follows its base layer's style (``ultrascale_declare_plan_edit`` moved those it could
    onto their base layers, so a PEFT layer still in the plan is one it could not)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    for fqn, module in model.named_modules():
        if isinstance(module, ParamWrapper) or (isinstance(module, LoraLayer) and any(module.use_dora.values())):
            what = ("LoRA on parameters (PEFT's target_parameters; its 'all-linear' adds a mixture-of-experts "
                    "model's expert and router weights)" if isinstance(module, ParamWrapper) else "DoRA")
            raise field_error("tp", facts.degree("tp"), f"{what} at '{fqn}' is not sharded over tensor parallel by this "
                              "version", "target modules by name (e.g. target_modules=['q_proj', 'k_proj', "
                              "'v_proj', 'o_proj']), use_dora=False, or tp: 1")
    for fqn, module, style in _adapted(model, plan):
        try:
            _adapter_entries(model, fqn, module, style)
        except _CannotFollow as exc:
            raise field_error("tp", facts.degree("tp"), f"the PEFT layer '{fqn}' cannot be sharded like its base ({exc})",
                              "leave that module out of the PEFT config (target_modules / modules_to_save), or use "
                              "tp: 1") from None
    head = model.get_submodule(plan.lm_head) if plan.lm_head else None
    if facts.vocab_sharded_loss and head is not None and not isinstance(head, nn.Linear):
        raise field_error("loss_parallel", True, f"the head '{plan.lm_head}' is wrapped by PEFT "
                          f"({type(head).__name__}), and its logits are not kept sharded", "set loss_parallel: false")

"""Built-in plugin: the model plan of any Hugging Face decoder whose config carries ``base_model_tp_plan``
(Llama, Qwen2, Mistral, Gemma, ...). Registered last, so an architecture-specific plugin can override it."""
from __future__ import annotations

from ..interface.hookspecs import hookimpl
from .delta_net_heads import STYLE as DELTA_NET, delta_net_entries, delta_net_style
from .expert_plan import expert_tp_entries, shared_expert_entries
from .plan import hf_plan_from_model


def full_tp_plan(model) -> dict[str, str]:
    """transformers keeps the base model's plan on the config (keys relative to the base model) and the head's
    plan on the causal-LM class; join them into one plan of full FQNs, with the fused experts the TP plan
    leaves to the expert-parallel plan and the shared experts it leaves whole (see expert_plan)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    plan = {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}
    head_plan = getattr(type(model), "_tp_plan", None)
    if isinstance(head_plan, dict):
        for k, v in head_plan.items():
            if not (prefix and k.startswith(prefix + ".")) and k.split(".")[0] not in base:
                plan.setdefault(k, v)
    ep_plan = {(f"{prefix}.{k}" if prefix else k): v
               for k, v in (getattr(model.config, "base_model_ep_plan", None) or {}).items()}
    plan.update(expert_tp_entries(model, ep_plan, plan))
    plan.update(shared_expert_entries(model, plan))
    return plan


@hookimpl(trylast=True)
def ultrascale_declare_model_plan(model, config):
    plan = full_tp_plan(model)
    if not plan:
        return None
    delta_net = delta_net_entries(model, plan, getattr(config, "tp", 1))  # head-parallel linear attention
    plan.update(delta_net)
    result = hf_plan_from_model(model, plan)
    if delta_net:
        result.styles[DELTA_NET] = delta_net_style
    # The embedding is sharded by vocabulary rows whenever the plan shards the head (torchtitan's and Megatron's
    # vocabulary-parallel embedding): a tied head and embedding share one tensor, so they must share one placement,
    # and an untied one would otherwise stay whole on every TP rank (vocab x hidden parameters, their gradients
    # and optimizer states). Its output is partial over TP: one all-reduce per forward (a reduce-scatter under
    # sequence parallel, which the first region's gather needed anyway).
    if result.embedding and result.lm_head in plan and result.embedding not in plan:
        result.tp_plan[result.embedding] = "embedding_rowwise"
    return result

"""The model plan of a model: the plugins' ``ModelPlan`` (``ultrascale_declare_model_plan``), found through a wrapper
(``ultrascale_declare_model_wrapper``: a PEFT model) and edited by every plugin (``ultrascale_declare_plan_edit``). Every place
that needs the plan asks here: the engine's checks and transforms, the estimate, the planner."""
from __future__ import annotations

from torch import nn

from ..interface.config import ParallelConfig
from ..models.plan import ModelPlan


def model_plan(model: nn.Module, config: ParallelConfig, pm=None) -> ModelPlan | None:
    """The plugins' ``ModelPlan`` for ``model``, found through a wrapper (``ultrascale_declare_model_wrapper``) and named
    from ``model``'s root."""
    pm = pm or config.registry
    wrapper = pm.wrapper_of(model)
    if wrapper.wraps:
        plan = pm.hook.ultrascale_declare_model_plan(model=wrapper.inner, config=config)
        plan = plan.rerooted(wrapper.prefix) if plan is not None else None
    else:
        plan = pm.hook.ultrascale_declare_model_plan(model=model, config=config)
    if plan is None:
        return None
    edits = [e for e in pm.hook.ultrascale_declare_plan_edit(model=model, plan=plan, config=config) if e is not None]
    return plan.edited(model, edits) if edits else plan

"""What tensor parallelism's plan decides about a model before anything is sharded, read by the transform
(``plugin.shard_model``) and by the costs (``costs``) alike: the regions one row-parallel layer hands back
(``simple_regions``) and, from a trace of the model's data flow, the parameters that meet only this rank's slice of
the features (``rank_local_params``)."""
from __future__ import annotations

from torch import nn

from ...interface.config import ConfigError
from ...models.plan import ROWWISE, region_holding
from .styles import takes_partial_input


def model_type(model) -> str:
    """The model's type as its config names it (a message's subject), else its class name."""
    return getattr(model.config, "model_type", type(model).__name__)


def simple_regions(plan, matched: dict) -> set[str]:
    """The regions whose output one row-parallel layer hands back directly (reduced, or reduce-scattered under
    SP); others (MoE blocks, several row-parallel layers) reduce a sum where they end (``TpDataflow.sums``) or,
    where the trace cannot show it is one, all-reduce inside and slice their output back to sequence shards."""
    regions = set(plan.regions)
    rows: dict[str, int] = {}
    whole = plan.whole_output_styles()
    opened = set()  # regions holding a module whose output is whole (experts): never simple
    for fqn, name in matched.items():
        region = region_holding(fqn, regions)
        if region is not None:
            rows[region] = rows.get(region, 0) + (name in ROWWISE or "rowwise" in name)
            if name in whole:
                opened.add(region)
    return {r for r in plan.regions if rows.get(r) == 1 and r not in opened}


def rank_local_params(model: nn.Module, plan):
    """The plain parameters that meet only this rank's slice of the features inside TP regions, those that meet
    both, and the regions that reduce their input's gradient once, from a trace of the model's data flow
    (``models.dataflow.TpDataflow``)."""
    from ...models.dataflow import trace_tp

    def partial_input(fqn, style, module):
        return takes_partial_input(style, plan.styles) and (style in plan.styles or style == "moe_tp_experts"
                                                             or isinstance(module, nn.Linear))

    try:
        return trace_tp(model, plan, partial_input)
    except Exception as exc:  # noqa: BLE001 - any failure means the data flow is unknown
        raise ConfigError(
            f"tp>1: could not trace the data flow of model type '{model_type(model)}' on the meta device "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}), so the parameters "
            "that need their gradients summed over TP are unknown. Fix: use tp: 1 for this model") from exc

"""The two hooks whose implementations hand one object along, run in the order of the stages' names: the cost
chain (``ultrascale_cost_estimate``: the dimensions cut ``shape.inventory`` in turn) and the batch split
(``ultrascale_step_shard_batch``: each dimension takes its part of the batch). Each implementation declares its place
with ``interface.stages.step`` (``Step``); ``stages.order_chain`` puts them in order, and this module calls them
one by one with the hook's arguments, as pluggy would, instead of in pluggy's own order (markers and registration).
An implementation that wraps (``wrapper=True``) or asks for ``tryfirst`` / ``trylast`` is refused: its place is a
name."""
from __future__ import annotations

import dataclasses

from ..interface.config import ConfigError
from ..interface.stages import STEP_MARK, Step, describe_chain, order_chain, placement

CHAINS = ("ultrascale_cost_estimate", "ultrascale_step_shard_batch")


def chain_steps(pm, hook: str) -> list[Step]:
    """Every implementation of ``hook`` (one of ``CHAINS``) as a ``Step``, in pluggy's call order, each with its
    plugin's name and its function in ``run``."""
    out: list[Step] = []
    for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):  # pluggy calls from the end of this list
        if impl.hookwrapper or impl.wrapper or impl.tryfirst or impl.trylast:
            raise ConfigError(f"plugin {impl.plugin_name}'s {hook} is marked wrapper/tryfirst/trylast: this chain "
                              "runs in the order of the stages' names. Fix: a plain @hookimpl placed with "
                              "@step(name, after=..., before=...) (ultrascale_plugins.interface.stages)")
        declared = getattr(impl.function, STEP_MARK, None)
        place = declared or Step(f"{impl.plugin_name}.{impl.function.__name__}", declared=False)
        out.append(dataclasses.replace(place, plugin=impl.plugin_name, run=_caller(impl)))
    return out


def _caller(impl):
    """``impl``'s function, called with the hook's keyword arguments it names (pluggy's way)."""
    def run(**kwargs):
        return impl.function(*(kwargs[name] for name in impl.argnames))
    return run


def ordered_chain(pm, hook: str, config, model_config=None) -> list[Step]:
    """``hook``'s implementations in the order of the stages ``config`` declares (``stages.order_chain``)."""
    return order_chain(pm.stages(config, model_config), chain_steps(pm, hook))


def run_chain(pm, hook: str, layout, model_config=None, /, **kwargs) -> None:
    """Call every implementation of ``hook`` with ``kwargs`` (the hook's arguments), in the order the stages of
    ``layout`` and ``model_config`` give."""
    for s in ordered_chain(pm, hook, layout, model_config):
        s.run(**kwargs)


def describe_step_hooks(pm, groups: dict, config, model_config=None) -> str:
    """Which plugins answer each hook of the ``step`` group, in the order they are called: the batch split in
    its declared order (each step's place), the others in pluggy's (a wrapper runs around the rest)."""
    stages = pm.stages(config, model_config)
    lines = []
    for hook in groups["step"]:
        if hook in CHAINS:
            steps = order_chain(stages, chain_steps(pm, hook))
            answers = [f"{s.plugin} [at {s.name}{': ' + placement(s) if placement(s) else ''}]" for s in steps]
        else:
            answers = [impl.plugin_name + (" [wrapper]" if impl.wrapper or impl.hookwrapper else "")
                       for impl in reversed(getattr(pm.hook, hook).get_hookimpls())]
        lines.append(f"{hook}: {' -> '.join(answers) if answers else '(none)'}")
    return "\n".join(lines)


def describe_cost_chain(pm, config, model_config=None) -> str:
    """The cost chain (``ultrascale_cost_estimate``) in the order it runs, one line per step with its place."""
    stages = pm.stages(config, model_config)
    return describe_chain(order_chain(stages, chain_steps(pm, "ultrascale_cost_estimate")), stages)

"""What one family decided that another needs to know, as one typed object.

A family reads another's decisions here, never through that family's layout fields: the degree of a mesh axis
by the axis's name, and the flags below. Each flag has one owner, the plugin that answers it from its own fields
in ``ultrascale_layout_facts``; the default is what holds when no installed plugin answers it (no data parallel:
nothing sharded). torchtitan passes the same couplings as explicit arguments (``enable_float8_tensorwise_tp``,
``cp_enabled``); here they travel in one object, so a third-party dimension can publish them as well.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from .fields import ConfigError


@dataclasses.dataclass(frozen=True)
class LayoutFacts:
    """The layout's mesh degrees and the flags other families read (``layout_facts(config)`` makes it).

    - ``fsdp_units``: each block is an FSDP2 unit of its own (ZeRO-2/3), so modules in a mesh view get FSDP2
      groups over the view's axes.
    - ``fsdp_shards``: how many row shards FSDP2 cuts a block's parameters into (1: held whole).
    - ``states_sharded``: FSDP2 holds this layout's gradients or optimizer states sharded (ZeRO-2/3 over more
      than one rank, or ZeRO-1 over tensor-parallel parameters).
    - ``grad_reduce``: ``step`` (gradients reduced once, after a step's last backward) or ``micro_batch`` (after
      every backward, so each backward's gradients must be complete when it ends).
    - ``compute_bytes``: bytes of an activation element (2 under bf16 compute).
    - ``param_bytes``: bytes of a weight element as held, and of its gradient and optimizer states (2: bf16).
    - ``sequence_sharded``: the activations between blocks are split over the sequence on the ``tp`` ranks.
    - ``vocab_sharded_loss``: the head's logits stay split over the vocabulary into the loss.
    - ``recompute``: what the backward recomputes of the forward: ``none``, ``selective`` or ``full``.
    - ``float8``: the float8 recipe the linear layers run (``none``: they do not).
    - ``loss_chunk``: the head and the loss run this many tokens at a time (0: the whole logits at once).
    - ``params_on_host``: the parameters (their shards) live in host memory, the device holds only what a step
      gathers; a meta-device build gives them host storage.
    - ``grads_freed_in_backward``: the optimizer steps each parameter inside the backward and frees its gradient
      there, so no rank holds the step's gradients at once.
    - ``activations_offloaded``: what the decoder layers save for their backward is held in host memory.
    - ``compiled``: how the decoder layers are compiled (``regional``: each by ``torch.compile``; ``none``).
    """

    degrees: Mapping[str, int] = dataclasses.field(default_factory=dict)
    fsdp_units: bool = False
    fsdp_shards: int = 1
    states_sharded: bool = False
    grad_reduce: str = "step"
    compute_bytes: int = 4
    param_bytes: int = 4
    sequence_sharded: bool = False
    vocab_sharded_loss: bool = False
    recompute: str = "none"
    float8: str = "none"
    loss_chunk: int = 0
    params_on_host: bool = False
    grads_freed_in_backward: bool = False
    activations_offloaded: bool = False
    compiled: str = "none"

    def degree(self, axis: str) -> int:
        """The degree of a mesh axis (a view's too), by name: 1 when no plugin declares it, -1 before a layout
        is resolved for the axis that takes the rest of the world."""
        return self.degrees.get(axis, 1)


FLAGS = tuple(f.name for f in dataclasses.fields(LayoutFacts) if f.name != "degrees")
_CACHE: dict = {}


def layout_facts(config, pm=None) -> LayoutFacts:
    """The facts of ``config`` (resolved or not): its axes' degrees and every plugin's answers to
    ``ultrascale_layout_facts``. A flag answered by two plugins, or unknown, is refused naming the plugins."""
    from .mesh_axes import declared
    from .plugins import get_plugin_manager

    pm = pm or get_plugin_manager()
    try:
        key = (id(pm), frozenset(map(id, pm.get_plugins())), config)  # a plugin (un)registered: new facts
        if key in _CACHE:
            return _CACHE[key]
    except TypeError:  # an unhashable stand-in for a config: not cached
        key = None
    axes, views = declared(config, pm)
    degrees = {a.name: a.degree for a in axes}
    for view in views:
        degrees.update({a.name: a.degree for a in view.axes})
    flags: dict = {}
    owners: dict = {}
    for impl in pm.hook.ultrascale_layout_facts.get_hookimpls():  # registration order
        answer = impl.function(config=config, degrees=degrees) or {}
        for name, value in answer.items():
            if name not in FLAGS:
                raise ConfigError(f"plugin '{impl.plugin_name}' answers the layout fact '{name}', which "
                                  f"LayoutFacts does not have. Fix: answer one of {', '.join(FLAGS)}")
            if name in owners:
                raise ConfigError(f"the layout fact '{name}' is answered by both '{owners[name]}' and "
                                  f"'{impl.plugin_name}'. Fix: leave it to one of them")
            owners[name] = impl.plugin_name
            flags[name] = value
    facts = LayoutFacts(degrees=degrees, **flags)
    if key is not None:
        if len(_CACHE) > 512:
            _CACHE.clear()
        _CACHE[key] = facts
    return facts

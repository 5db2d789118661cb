"""The derived facts of a layout, in one typed object (torchtitan's ``ParallelDims`` is the model).

Each dimension plugin declares its mesh axes through ``ultrascale_mesh_axes`` as ``MeshAxis`` values: a name, a
degree (``-1``: whatever the world leaves), a position from the outermost to the innermost axis, and what the axis
means for the step — whether the batch rows are split over it (data loading), whether gradients are averaged over
it and whether the loss's valid tokens are counted over it. ``ParallelDims`` derives from them everything the
engine and the front ends need: the world-size product, the device mesh and its sub-meshes, the data-parallel
degree and rank, and the loss-scale rule.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from .fields import ConfigError

# Positions of the built-in axes (smaller = outer). TP is innermost: consecutive ranks share the fastest links.
PP_ORDER, DP_REPLICATE_ORDER, DP_SHARD_ORDER, CP_ORDER, TP_ORDER = 0, 20, 30, 40, 50


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One axis of the device mesh.

    - ``splits_rows``: each rank along it reads different rows of the global batch (the data loader's shard).
    - ``reduces_grads``: gradients are averaged over it after backward, and the local loss is scaled by its degree
      so the average is the gradient of the global mean. The engine does the averaging unless a plugin's wrapper
      claims the axis (``ctx.claim_grad_reduction``: FSDP and DDP do it themselves).
    - ``counts_tokens``: each rank along it holds different tokens, so the loss's valid-token count and the loss
      value are summed over it.
    """

    name: str
    degree: int
    order: int = 10
    splits_rows: bool = False
    reduces_grads: bool = False
    counts_tokens: bool = False


def declared_axes(config, pm=None) -> list[MeshAxis]:
    """Every plugin's axes for ``config``, outermost first."""
    from .plugins import get_plugin_manager

    pm = pm or get_plugin_manager()
    axes: dict[str, MeshAxis] = {}
    for result in pm.hook.ultrascale_mesh_axes(config=config):
        for axis in result or []:
            if not isinstance(axis, MeshAxis):
                raise ConfigError(f"a plugin's ultrascale_mesh_axes returned {axis!r}. Fix: return MeshAxis values")
            if axis.name in axes:
                raise ConfigError(f"mesh axis '{axis.name}' is declared by two plugins. Fix: rename one of them")
            axes[axis.name] = axis
    return sorted(axes.values(), key=lambda a: (a.order, a.name))


def resolve(config, world_size: int, pm=None, check: bool = True):
    """``config`` with its ``-1`` degree filled in, after checking the axes' product against the world size and
    running every plugin's field checks that need no model (``ultrascale_validate_config``; ``check=False``
    skips them: the planner costs layouts this engine cannot run)."""
    from .plugins import get_plugin_manager

    pm = pm or get_plugin_manager()
    axes = declared_axes(config, pm)
    free = [a for a in axes if a.degree == -1]
    fixed = [a for a in axes if a.degree != -1]
    product = math.prod(a.degree for a in fixed)
    formula = "*".join(a.name for a in axes)
    values = "*".join(str(a.degree) for a in axes)
    if len(free) > 1:
        raise ConfigError(f"{' and '.join(a.name for a in free)} are both -1: only one degree can take the rest of "
                          "the world. Fix: give all but one of them a number")
    if free:
        if world_size % product:
            names = "*".join(a.name for a in fixed)
            raise ConfigError(f"{names} = {'*'.join(str(a.degree) for a in fixed)} = {product} does not divide the "
                              f"world size {world_size}. Fix: pick degrees whose product divides {world_size}")
        config = config.replace(**{free[0].name: world_size // product})
    elif product != world_size:
        raise ConfigError(f"{formula} = {values} = {product} but the world size is {world_size}. Fix: make the "
                          f"product {world_size}, or set dp_shard: -1 to use the rest")
    config = fill_auto(config)
    if check:
        pm.hook.ultrascale_validate_config(config=config, model_config=None, world_size=world_size)
    return config


def fill_auto(config):
    """``config`` with every field set to ``"auto"`` replaced by what its plugin derives from the (resolved)
    degrees, e.g. ``sequence_parallel: auto`` -> on whenever ``tp > 1``."""
    from .fields import AUTO
    from .plugins import layout_fields

    derived = {f.name: f.auto(config) for f in layout_fields() if f.auto is not None
               and getattr(config, f.name, None) == AUTO}
    return config.replace(**derived) if derived else config


class ParallelDims:
    """A resolved layout: its axes, the mesh once built, and the rules derived from them."""

    def __init__(self, config, world_size: int | None = None, pm=None):
        self.config = config  # resolved
        self.world_size = world_size
        self.axes = declared_axes(config, pm)
        self.mesh = None

    # ---- degrees --------------------------------------------------------------------------------------
    def degree(self, name: str) -> int:
        return next((a.degree for a in self.axes if a.name == name), 1)

    def enabled(self, name: str) -> bool:
        return self.degree(name) > 1

    @property
    def live_axes(self) -> list[MeshAxis]:
        """The axes of degree > 1, outermost first (degree-1 axes are left out of the mesh)."""
        return [a for a in self.axes if a.degree > 1]

    def _names(self, flag: str) -> tuple[str, ...]:
        return tuple(a.name for a in self.live_axes if getattr(a, flag))

    @property
    def row_axes(self) -> tuple[str, ...]:
        return self._names("splits_rows")

    @property
    def grad_axes(self) -> tuple[str, ...]:
        return self._names("reduces_grads")

    @property
    def token_axes(self) -> tuple[str, ...]:
        return self._names("counts_tokens")

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different row shards of the global batch there are."""
        return math.prod(self.degree(n) for n in self.row_axes)

    @property
    def grad_scale(self) -> int:
        """The loss-scale rule: a rank's token-loss sum times ``grad_scale / global_valid_tokens`` has, after the
        gradient averaging over ``grad_axes``, the gradient of the global-mean loss."""
        return math.prod(self.degree(n) for n in self.grad_axes)

    @property
    def fsdp(self) -> bool:
        """Parameters (ZeRO-3) or gradients and optimizer states (ZeRO-2) sharded by FSDP2 over dp_shard."""
        return self.config.zero_stage >= 2 and self.degree("dp_shard") > 1

    def coordinate(self, rank: int, names: tuple[str, ...]) -> int:
        """This rank's index within the flattened ``names`` axes, from the axis order alone (no process group:
        front ends may need the data-parallel rank before the mesh exists)."""
        strides, stride = {}, 1
        for axis in reversed(self.live_axes):
            strides[axis.name] = stride
            stride *= axis.degree
        index = 0
        for name in names:
            index = index * self.degree(name) + (rank // strides[name]) % self.degree(name)
        return index

    # ---- the mesh -------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str):
        from .mesh import build_mesh

        self.mesh = build_mesh(device_type, self.live_axes, [self.row_axes, self.grad_axes, self.token_axes])
        return self.mesh

    def sub_mesh(self, names: str | tuple[str, ...]) -> Any:
        """The mesh over ``names`` (one axis or several, flattened), or None when all have degree 1."""
        from .mesh import sub_mesh

        return sub_mesh(self.mesh, names)

    def group(self, names: str | tuple[str, ...]):
        mesh = self.sub_mesh(names)
        return mesh.get_group() if mesh is not None else None

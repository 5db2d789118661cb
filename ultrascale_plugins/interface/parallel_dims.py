"""The derived facts of a layout, in one typed object (torchtitan's ``ParallelDims`` is the model).

Each dimension plugin declares its mesh axes through ``ultrascale_declare_mesh_axes`` as ``MeshAxis`` values: a name, a
degree (``-1``: whatever the world leaves), its place among the others by name (``after`` / ``before``: the mesh
lists them outermost first), and what the axis means for the step — whether the batch rows are split over it
(data loading), whether gradients are averaged over it and whether the loss's valid tokens are counted over it.
``ParallelDims`` derives from them everything the engine and the front ends need: the world-size product, the
device mesh and its sub-meshes, the data-parallel degree and rank, and the loss-scale rule.

A plugin may also carve axes out of others (``MeshView``: torchtitan's expert mesh, where ``ep`` and the
expert-side data-parallel degree ``efsdp`` re-split the ranks of dp_shard x cp x tp). A view counts the same ranks
again, so it adds nothing to the world-size product; the modules a model plan puts in a view
(``PlanEdit.views``) are data-parallel over the view's gradient axes instead of the layout's.
"""
from __future__ import annotations

import math
from typing import Any

from .mesh_axes import MeshAxis


def changed_fields(config, said: set[str]) -> list[str]:
    """The fields of ``config`` set away from their plugins' defaults, other than ``said``, as the layout line says
    them (``Field.said``: the field's own ``words``, else a flag switched on by its name and the rest as name=value):
    read from the fields the plugins declare, so a feature needs no line of its own here to be shown. The fields
    their plugins word come first (the features a run turned on, said as a reader knows them), each group in
    declaration order. A field left "auto" is compared with what its plugin derives (it is no setting of the
    user's)."""
    from .fields import AUTO

    out = []
    for field in sorted(config.registry.fields, key=lambda f: f.words is None):  # stable: declaration order kept
        value = getattr(config, field.name)
        default = field.auto(config) if field.auto is not None and field.default == AUTO else field.default
        if field.name not in said and value != default:
            out.append(field.said(value))
    return out


class ParallelDims:
    """A resolved layout: its axes, the mesh once built, and the rules derived from them."""

    def __init__(self, config, world_size: int | None = None):
        self.config = config  # resolved
        self.world_size = world_size
        self.axes = config.registry.axes(config)
        self.views = {v.name: v for v in config.registry.views(config, self.axes)}
        self.timeout = None  # the bound on every collective of the mesh's groups, given to ``build_mesh``
        self.mesh = None
        self.view_meshes: dict[str, Any] = {}

    # ---- degrees --------------------------------------------------------------------------------------
    def degree(self, name: str) -> int:
        """The degree of a layout axis, or of a view's axis."""
        found = next((a.degree for a in self.axes if a.name == name), None)
        if found is None:
            found = next((a.degree for v in self.views.values() for a in v.axes if a.name == name), 1)
        return found

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
    def facts(self):
        """What the families decided for each other (``facts.LayoutFacts``): read a flag there, not another
        family's field."""
        return self.config.registry.facts(self.config)

    def view_axes(self, view: str) -> list[MeshAxis]:
        """The axes of ``view``'s mesh, outermost first: the layout's live axes with the view's source replaced by
        the view's own axes (all of them, degree 1 included)."""
        spec = self.views[view]
        out: list[MeshAxis] = []
        for axis in self.axes:
            if axis.name in spec.source:
                if axis.name == next(a.name for a in self.axes if a.name in spec.source):
                    out.extend(spec.axes)  # where the source starts
            elif axis.degree > 1:
                out.append(axis)
        return out

    def view_grad_axes(self, view: str | None) -> tuple[str, ...]:
        """The axes the gradients of a module in ``view`` (None: the layout) are summed over."""
        if view is None:
            return self.grad_axes
        return tuple(a.name for a in self.view_axes(view) if a.reduces_grads)

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

    def describe(self) -> str:
        """The layout in one line, as every front end logs the one it applied (``ultrascale: N processes, layout
        ...``): each live axis in mesh order as its plugin words it (``MeshAxis.describe``), then the views, then
        every other field the layout sets away from its default (``changed_fields``: the memory features a run
        turned on). Every word comes from a plugin's declaration, so a third party's axis or field is said as a
        built-in one is."""
        parts = [axis.describe() for axis in self.live_axes]
        for view in self.views.values():  # axes carved from the layout's ranks
            parts.append(f"{view.name} over {', '.join(f'{a.name}={a.degree}' for a in view.axes)} "
                         f"(the ranks of {'*'.join(view.source)})")
        # the fields the parts above say: the degrees of every axis (a degree of 1 says nothing), the live axes' words
        said = {a.name for a in self.axes} | {a.name for v in self.views.values() for a in v.axes}
        said.update(name for axis in self.live_axes for name in axis.says)
        parts += changed_fields(self.config, said)
        return " x ".join(parts) or "single process"

    # ---- the mesh -------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str, timeout):
        """The mesh and its views' meshes, every process group bounded by ``timeout`` (a ``timedelta``)."""
        from .mesh import build_mesh

        self.timeout = timeout
        self.mesh = build_mesh(device_type, self.live_axes, [self.row_axes, self.grad_axes, self.token_axes], timeout)
        for name in self.views:  # every rank builds every view, in the same order: each creates process groups
            self.view_meshes[name] = build_mesh(device_type, self.view_axes(name), [self.view_grad_axes(name)],
                                                timeout, keep_unit=True)
        return self.mesh

    def sub_mesh(self, names: str | tuple[str, ...], view: str | None = None) -> Any:
        """The mesh over ``names`` (one axis or several, flattened), or None when all have degree 1. In a ``view``:
        the view's mesh over ``names`` (its degree-1 axes included)."""
        from .mesh import sub_mesh

        if view is not None:
            return sub_mesh(self.view_meshes.get(view), names, self.timeout, keep_unit=True)
        return sub_mesh(self.mesh, names, self.timeout)

    def view_mesh(self, view: str) -> Any:
        """The whole mesh of ``view`` (its axes named as the view declares them; index it by name)."""
        return self.view_meshes[view]

    def group(self, names: str | tuple[str, ...]):
        mesh = self.sub_mesh(names)
        return mesh.get_group() if mesh is not None else None

"""The mesh axes and views the dimension plugins declare (``ultrascale_declare_mesh_axes``): the value types
(``MeshAxis``, ``MeshView``) and the check of a view against the axes it is carved from. The registry
(``core.registry``) collects and orders the declarations; ``parallel_dims`` derives a layout's rules from them."""
from __future__ import annotations

import dataclasses
import math

from .fields import ConfigError
from .ordering import as_names


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One axis of the device mesh.

    - ``after`` / ``before``: the axes this one lies inside / outside of (a name or a tuple of names; the mesh
      lists axes outermost first). The mesh's order is decided from these declarations alone
      (``ordering.order_by_names``), as the model transforms' is: a third party places its axis by name,
      ``MeshAxis("acme_dp", n, after="dp_replicate", before="dp_shard")``. Built-in order, outermost first:
      pp, dp_replicate, dp_shard, cp, tp (innermost: consecutive ranks share the fastest links).
    - ``splits_rows``: each rank along it reads different rows of the global batch (the data loader's shard).
    - ``reduces_grads``: gradients are averaged over it after backward, and the local loss is scaled by its degree
      so the average is the gradient of the global mean. The engine does the averaging unless a plugin's wrapper
      claims the axis (``ctx.claim_grad_reduction``: FSDP and DDP do it themselves).
    - ``counts_tokens``: each rank along it holds different tokens, so the loss's valid-token count and the loss
      value are summed over it.
    - ``words``: what the layout line (``ParallelDims.describe``) says after ``name=degree`` when the axis is live,
      e.g. ``"(ZeRO-3)"`` or ``"+ sequence parallel"``: the axis's plugin words its own settings, so the line
      needs no knowledge of any family. ``says``: the fields those words say already (a name or a tuple of
      names), which the line's list of changed fields then leaves out.

    In a ``MeshView`` the view's tuple gives the order, and ``after`` / ``before`` are left empty.
    """

    name: str
    degree: int
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    splits_rows: bool = False
    reduces_grads: bool = False
    counts_tokens: bool = False
    words: str = dataclasses.field(default="", compare=False)  # how the layout line is said: no part of the mesh
    says: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self):  # a single name may be given as a plain string
        for names in ("after", "before", "says"):
            object.__setattr__(self, names, as_names(getattr(self, names)))

    def describe(self) -> str:
        """This axis's part of the layout line: ``name=degree``, then its plugin's ``words``."""
        return f"{self.name}={self.degree}" + (f" {self.words}" if self.words else "")


@dataclasses.dataclass(frozen=True)
class MeshView:
    """Axes carved from others: the ranks of ``source`` (axes of the layout, flattened outer to inner) counted
    again as ``axes`` (outer to inner; one may have degree -1, what the source leaves). The view is the layout's
    mesh with ``source`` replaced by ``axes``: the same ranks, grouped differently for the modules a model plan
    puts in it (``PlanEdit.views``). Its axes' flags mean what a ``MeshAxis``'s do, for those modules:
    ``reduces_grads`` marks the axes their parameters are data-parallel over (sharded by ZeRO, gradients summed);
    ``splits_rows`` and ``counts_tokens`` must stay False (rows and tokens are the layout's). Degree-1 axes of a
    view stay in its mesh, so a module in the view always has a mesh to be sharded over."""

    name: str
    source: tuple[str, ...]
    axes: tuple[MeshAxis, ...]


def resolved_view(view: MeshView, axes: list[MeshAxis]) -> MeshView:
    """``view`` with its -1 degree filled in, checked against the layout's ``axes`` it is carved from."""
    names = [a.name for a in axes]
    missing = [s for s in view.source if s not in names]
    if missing:
        raise ConfigError(f"mesh view '{view.name}' is carved from {'/'.join(missing)}, which no plugin declares. "
                          "Fix: install the plugin that declares it, or carve the view from declared axes")
    where = sorted(names.index(s) for s in view.source)
    if where != list(range(where[0], where[0] + len(where))):
        raise ConfigError(f"mesh view '{view.name}' is carved from {'*'.join(view.source)}, which are not adjacent "
                          f"in the mesh ({' > '.join(names)}). Fix: carve it from adjacent axes")
    for axis in view.axes:
        if axis.splits_rows or axis.counts_tokens:
            raise ConfigError(f"axis '{axis.name}' of mesh view '{view.name}' splits rows or counts tokens, which only "
                              "the layout's axes do. Fix: leave those flags False in a view")
    total = math.prod(axes[i].degree for i in where)
    fixed = math.prod(a.degree for a in view.axes if a.degree != -1)
    free = [a for a in view.axes if a.degree == -1]
    formula = "*".join(a.name for a in view.axes)
    source = "*".join(view.source)
    if len(free) > 1 or total % fixed or (not free and fixed != total):
        raise ConfigError(f"mesh view '{view.name}': {formula} must re-split {source} = {total} ranks, and "
                          f"{'*'.join(str(a.degree) for a in view.axes)} does not. Fix: pick degrees whose product is "
                          f"{total}")
    filled = tuple(dataclasses.replace(a, degree=total // fixed) if a.degree == -1 else a for a in view.axes)
    return dataclasses.replace(view, axes=filled)

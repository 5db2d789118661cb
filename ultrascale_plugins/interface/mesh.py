"""One DeviceMesh with named axes, outermost to innermost, as ``ParallelDims`` orders them (built-ins: pp,
dp_replicate, dp_shard, tp; plugin axes where their ``order`` puts them). Axes of degree 1 are left out.

Several axes used together (the data-parallel rows, the gradient-averaging axes, the token-counting axes) get a
flattened view: the engine's are made here, on every rank at once because flattening creates process groups;
others on first use.
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout


def flat_name(names: tuple[str, ...]) -> str:
    return "+".join(names)


def build_mesh(device_type: str, axes, flattened: list[tuple[str, ...]], timeout,
               keep_unit: bool = False) -> DeviceMesh | None:
    """The mesh of ``axes`` (outermost first) and the flattened views ``flattened``, every group bounded by
    ``timeout``; ``keep_unit``: degree-1 axes given stay in it (a ``MeshView``'s), else none is given."""
    if not axes:
        return None
    mesh = init_device_mesh(device_type, tuple(a.degree for a in axes), mesh_dim_names=tuple(a.name for a in axes))
    for name in mesh.mesh_dim_names:
        _bound(mesh.get_group(name), timeout)
    for names in flattened:
        names = tuple(n for n in names if keep_unit or mesh.size(mesh.mesh_dim_names.index(n)) > 1)
        if len(names) > 1:
            _flattened(mesh, names, timeout)
    return mesh


def _bound(group, timeout) -> None:
    # new_group() gives sub-groups torch's 30-minute default, not the job's timeout: set it on each, so a dead
    # or stalled peer becomes an error within the job's bound instead of a long hang.
    if timeout is not None:
        _set_pg_timeout(timeout, group)


def _flattened(mesh: DeviceMesh, names: tuple[str, ...], timeout) -> DeviceMesh:
    """The flattened view of ``names``, made on first use (every rank asks for it in the same order: flattening
    creates a process group)."""
    try:
        return mesh[flat_name(names)]
    except KeyError:
        view = mesh[names]._flatten(flat_name(names))
        _bound(view.get_group(), timeout)
        return view


def sub_mesh(mesh: DeviceMesh | None, names, timeout=None, keep_unit: bool = False) -> DeviceMesh | None:
    """The named axis, or the flattened view of several (built by ``build_mesh``); axes of degree 1 are skipped
    (``keep_unit``: kept when the mesh has them); None when none is left."""
    if mesh is None:
        return None
    present = mesh.mesh_dim_names or ()
    names = (names,) if isinstance(names, str) else tuple(names)
    names = tuple(n for n in names if n in present)
    if not keep_unit:
        names = tuple(n for n in names if mesh.size(present.index(n)) > 1)
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    return _flattened(mesh, names, timeout)


_UNIT: dict = {}


def unit_mesh(device_type: str, name: str, timeout) -> DeviceMesh:
    """A mesh of this rank alone, axis ``name``: what FSDP2 needs to hold a rank's parameters in its own groups
    without sharding them (offloaded to the host with one data-parallel rank). Every rank calls it at once (each
    one-rank group is created by all), once per launched process and name; a world of one makes it anew (its
    process group may be replaced in one process)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return init_device_mesh(device_type, (1,), mesh_dim_names=(name,))
    key = (device_type, name)
    if key not in _UNIT:
        group, _ = dist.new_subgroups(group_size=1, timeout=timeout)
        _UNIT[key] = DeviceMesh.from_group(group, device_type, mesh_dim_names=(name,))
    return _UNIT[key]

"""One DeviceMesh with named axes, outermost to innermost: pp, (plugin axes), dp_replicate, dp_shard, cp, tp.

TP is innermost because consecutive ranks share the fastest links (one node). Axes of degree 1 are left out;
``sub_mesh`` returns None for them. Flattened views: ``dp`` (data loading and loss reduction), ``dp_shard_cp``
(what FSDP shards over) and ``dp_cp``.
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from .launch import collective_timeout

CANONICAL_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


def order_axes(axes: dict[str, int]) -> list[tuple[str, int]]:
    extra = [name for name in axes if name not in CANONICAL_ORDER]
    names = ["pp", *extra, "dp_replicate", "dp_shard", "cp", "tp"]
    return [(n, axes[n]) for n in names if n in axes and axes[n] > 1]


def build_mesh(device_type: str, axes: dict[str, int]) -> DeviceMesh | None:
    ordered = order_axes(axes)
    if not ordered:
        return None
    mesh = init_device_mesh(device_type, tuple(d for _, d in ordered), mesh_dim_names=tuple(n for n, _ in ordered))
    groups = [mesh.get_group(name) for name in mesh.mesh_dim_names]
    for alias, parts in FLATTENED.items():
        present = tuple(p for p in parts if p in mesh.mesh_dim_names)
        if len(present) > 1:
            groups.append(mesh[present]._flatten(alias).get_group())
    # new_group() gives sub-groups torch's 30-minute default, not the job's timeout: set it on each, so a dead
    # or stalled peer becomes an error within the job's bound instead of a long hang.
    for group in groups:
        _set_pg_timeout(collective_timeout(), group)
    return mesh


def sub_mesh(mesh: DeviceMesh | None, name: str) -> DeviceMesh | None:
    """The named axis or flattened view, or None when every axis it covers has degree 1."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    if name in names:
        return mesh[name]
    parts = tuple(p for p in FLATTENED.get(name, ()) if p in names)
    if len(parts) == 1:
        return mesh[parts[0]]
    if len(parts) > 1:
        return mesh[name]
    return None

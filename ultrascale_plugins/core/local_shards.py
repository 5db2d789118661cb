"""This rank's shards of a model built on the meta device: storage for them where the layout holds them (tied
parameters kept tied, the computed buffers restored), the part of a whole tensor this rank holds under a DTensor's
placements (computed locally, no communication), and that part copied in. The first and last steps of every
loader, whether the values are read from files (``checkpoints.pretrained``) or drawn (``initialize.ModelInit``).
"""
from __future__ import annotations

import torch
from torch import nn

# wrapper segments torch inserts into parameter names (checkpoint_wrapper, torch.compile, FSDP1); the engine's own
# transforms keep the unparallelized names, these only matter for a model wrapped before it was parallelized
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def unwrapped_name(name: str) -> str:
    """A parameter's or buffer's name in the unparallelized model: ``name`` without torch's wrapper segments."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def to_empty_tied(module: nn.Module, device, param_device=None) -> None:
    """``module.to_empty(device=device)`` that keeps tied parameters tied: ``to_empty`` replaces a plain
    parameter by a new one in every module that holds it (DTensor parameters are swapped in place, so tied ones
    stay one object). Each group of names that held one parameter is pointed back at a single new one.
    ``param_device``: the parameters' storage there instead (the host, when they are offloaded), the buffers'
    on ``device``."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, name))
    module.to_empty(device=param_device or device)
    if param_device is not None and param_device != device:
        for m in module.modules():
            for key, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[key] = torch.empty_like(buf, device=device)
    for refs in holders.values():
        keep = refs[0][0]._parameters[refs[0][1]]
        for m, name in refs[1:]:
            m._parameters[name] = keep


@torch.no_grad()
def give_storage(ctx, buffers: dict[str, torch.Tensor], computed: dict[str, torch.Tensor] | None = None) -> None:
    """Give this rank's model parts (``ctx.modules``, in their final layout) storage — the parameters where the
    layout holds them (``ctx.param_device``, when a context has one), tied ones kept tied — and their buffers the
    values computed at construction: ``buffers`` by name, else ``computed`` by the unparallelized name, else zero
    (``to_empty`` leaves them uninitialised). The first step of every loader (``ModelInit.load``,
    ``pretrained.PretrainedWeights.load``), before any value is read or drawn."""
    for module in ctx.modules:
        to_empty_tied(module, ctx.device, getattr(ctx, "param_device", None))  # a context of the caller's own too
        for name, buf in module.named_buffers():
            source = buffers.get(name)
            if source is None and computed is not None:
                source = computed.get(unwrapped_name(name))
            if source is not None and not source.is_meta:
                buf.copy_(source)
            else:
                buf.zero_()


def copy_part(param: torch.Tensor, local: torch.Tensor, part: torch.Tensor) -> None:
    """``local.copy_(part)``, where ``local`` is this rank's part of ``param`` (its ``to_local()``, or ``param``)
    and may be a tensor subclass of several inner tensors (torchao's NF4Tensor). The inner tensors a meta-device
    build left without storage are taken from ``part``: those every part holds whole, which the layout neither
    shards nor moves (FSDP2 and ``to_empty`` carry NF4's scales' mean and code book over from the meta tensor as
    they are). They are set on the tensor the DTensor holds (``_local_tensor``: ``to_local`` of a parameter
    returns a view of it, a separate object, since torch 2.11)."""
    local.copy_(part)
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None or type(local) in (torch.Tensor, nn.Parameter) or type(part) is not type(local):
        return
    holder = getattr(param, "_local_tensor", param)
    for name in flatten()[0]:
        if getattr(local, name).is_meta:
            value = getattr(part, name).detach().to(local.device, copy=True)
            for tensor in {id(holder): holder, id(local): local}.values():
                setattr(tensor, name, value)


def local_chunk(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's part of ``full`` under ``placements`` over ``mesh``, computed locally (no communication): the
    placements are applied left to right, as ``distribute_tensor(..., src_data_rank=None)`` does, but on the CPU
    tensor, so only the local chunk ever reaches the device."""
    from torch.distributed.tensor import Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover
        _StridedShard = Shard
    coordinate = mesh.get_coordinate()
    out = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):
            pieces, _ = placement._split_tensor(out, mesh.size(mesh_dim), with_padding=False, contiguous=False)
            out = pieces[coordinate[mesh_dim]]
        elif placement.is_partial():
            raise RuntimeError(f"a parameter placed {placements} (partial) cannot be initialized")
    return out

"""Fill a model's shards from a pretrained Hugging Face directory (``save_pretrained``: safetensors, one file or
sharded) without any rank holding the whole model: the loader the engine calls once the layout is final.

The model was built on the meta device and its reads planned before any process group existed (``read_plan``:
names matched, tied weights resolved, shapes checked); once parallelized — pipeline split, TP, FSDP — every rank
gives only its own shards storage and reads exactly those slices from the files (PyTorch distributed checkpoint's
``HuggingFaceStorageReader`` plans the reads from each DTensor's local chunk and reads them with
``safe_open(...).get_slice``). A parameter transformers' conversion mapping fuses is built from the tensors its
converter names (``fused_source``); what no file holds (a PEFT model's adapters) is drawn by the initializer the
caller made (``initialize.ModelInit``).

    pmodel = ultrascale_plugins.from_pretrained("my-model/", ParallelConfig(tp=2))   # checkpoints.load
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..core.local_shards import copy_part, give_storage, local_chunk
from .errors import CheckpointError
from .fused_source import FusedSource
from .read_plan import ReadPlan


@dataclasses.dataclass
class PretrainedWeights(ReadPlan):
    """The planned reads of an HF directory (``read_plan.plan_reads``) as a loader (``load(ctx, buffers)``), with
    what the caller asked once before any process group: the initializer of the entries a plugin introduced
    (``initialize.ModelInit``: the plugin's own scheme, seeded by the entry's name; None when there are none),
    the model's wrapper and the registry."""

    init: object = None
    wrapper: object = None  # the model's ``ModelWrapper``: the values computed from others (DoRA's magnitude)
    pm: object = None  # the registry: the dimensions' views of the tensors they placed in pieces

    def load(self, ctx, buffers: dict[str, torch.Tensor]) -> None:
        """Give this rank's (sharded) parameters storage and their pretrained values; restore the buffers
        computed at construction (``to_empty`` leaves them uninitialised); draw the entries a plugin introduced
        (``introduced``), then set the values computed from others (``ModelWrapper.init_dependent``: DoRA's
        magnitude, from the loaded base)."""
        import torch.distributed.checkpoint as dcp
        from safetensors import safe_open
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             set_model_state_dict)

        give_storage(ctx, buffers)  # tied parameters kept tied, where the layout holds them; the computed buffers
        for module in ctx.modules:
            state = get_model_state_dict(module)
            # one read per file key; a second local tensor wanting the same key (a tied weight held by two
            # stages of this rank) is copied from the first after the read
            reads: dict[str, torch.Tensor] = {}
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            fused: list[tuple[FusedSource, torch.Tensor]] = []
            apart: list[tuple[str, str]] = []  # (model key, file key) of entries held in another form: read whole
            for key, tensor in state.items():
                source = self.sources.get(key)
                if source is None:
                    if key in self.fused:
                        fused.append((self.fused[key], tensor))
                    continue  # else a buffer the files do not hold (checked before the process group existed)
                if _held_apart(tensor):
                    apart.append((key, source))
                    continue
                if source in reads:
                    copies.append((tensor, reads[source]))
                else:
                    reads[source] = tensor
            try:
                if reads:  # a TP-packed parameter (GPT-2's c_attn) is read as its true pieces, as checkpoints do
                    from .sharded import dcp_view

                    dcp.load({k: dcp_view(v, self.pm) for k, v in reads.items()},
                             storage_reader=HuggingFaceStorageReader(str(self.path)))
                with contextlib.ExitStack() as files:  # one parameter at a time, each file opened once
                    opened = {}

                    def read(item: tuple[str, str]) -> torch.Tensor:
                        key, name = item
                        if name not in opened:
                            opened[name] = files.enter_context(safe_open(str(self.path / name), framework="pt"))
                        return opened[name].get_tensor(key)

                    for source, tensor in fused:
                        source.load_into(tensor, read)
                    for key, source in apart:
                        self._load_apart(module.get_parameter(key), read((source, self.files[source])))
            except Exception as exc:
                raise CheckpointError(f"pretrained weights in '{self.path}' could not be read: "
                                      f"{exc}".splitlines()[0]) from exc
            with torch.no_grad():
                for dst, src in copies:
                    dst.copy_(src)
            for key, _ in apart:  # written into the parameters themselves
                state.pop(key)
            set_model_state_dict(module, state, options=StateDictOptions(strict=not apart))
        with torch.no_grad():
            if self.init is not None:
                self.init.fill(ctx.modules, only=set(self.introduced))
            if self.wrapper is not None:
                self.wrapper.init_dependent(list(ctx.modules))

    @torch.no_grad()
    def _load_apart(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """One parameter held in another form than the files' (a quantized base): its whole value as the model's
        wrapper holds it (``ModelWrapper.held_value``: quantized whole), then this rank's part of that."""
        from torch.distributed.tensor import DTensor

        local = param.to_local() if isinstance(param, DTensor) else param
        held = full if self.wrapper is None else self.wrapper.held_value(local, full)
        part = local_chunk(held, param.device_mesh, param.placements) if isinstance(param, DTensor) else held
        if tuple(part.shape) != tuple(local.shape):
            raise RuntimeError(f"local shard {tuple(local.shape)} but the layout gives {tuple(part.shape)}")
        copy_part(param, local, part)


def _held_apart(tensor: torch.Tensor) -> bool:
    """Whether a parameter's local part is a tensor subclass (torchao's NF4Tensor), which a checkpoint reader
    cannot fill in place: it is read whole and converted (``PretrainedWeights._load_apart``)."""
    from torch.distributed.tensor import DTensor

    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return type(local) not in (torch.Tensor, torch.nn.Parameter)

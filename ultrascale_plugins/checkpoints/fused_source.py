"""A parameter that transformers' conversion mapping builds from several tensors of a pretrained directory's files
(transformers >= 5 holds a MoE layer's experts as 3-D parameters, ``mlp.experts.gate_up_proj``, while the hub's
checkpoints and its own ``save_pretrained`` store them per expert, ``mlp.experts.<e>.gate_proj.weight``): the keys it
is built from and the converter's own operations that build it, run on meta tensors when the reads are planned
(``read_plan``: the shapes checked) and on this rank's rows when its shard is filled (``pretrained``).
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from ..core.local_shards import local_chunk


@dataclasses.dataclass
class FusedSource:
    """A parameter that transformers' conversion mapping builds from several tensors of the files (e.g. a MoE
    layer's ``experts.gate_up_proj`` from every expert's ``gate_proj``/``up_proj``): the ``WeightConverter``
    transformers would use and the keys it collects, in transformers' order (expert 0, 1, ..., 10)."""

    converter: object  # transformers.core_model_loading.WeightConverter, nothing collected
    first: str  # the model key the checkpoint keys are renamed to (the converter's first target)
    target: str  # the model key this entry fills (one of the converter's outputs)
    parts: dict[str, list[tuple[str, str]]]  # converter source pattern -> [(file key, file name)]

    def by_rows(self) -> bool:
        """Whether row i of the parameter comes from the i-th key of each part only (experts stacked on dim 0,
        then joined along another dim), so that a shard of rows needs only those keys."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        first, *rest = self.converter.operations
        return (isinstance(first, MergeModulelist) and first.dim == 0
                and all(isinstance(op, Concatenate) and op.dim != 0 for op in rest))

    def assemble(self, read, rows: list[int] | None = None) -> dict[str, torch.Tensor]:
        """The converter's outputs from ``read((key, file))`` of its keys (only the ``rows``-th of each part if
        given: then the output holds those rows of the parameter, see ``by_rows``)."""
        converter = copy.deepcopy(self.converter)
        for pattern, items in self.parts.items():
            for item in (items if rows is None else [items[i] for i in rows]):
                converter.add_tensor(self.first, item[0], pattern, functools.partial(read, item))
        return converter.convert(self.first)

    @torch.no_grad()
    def load_into(self, tensor: torch.Tensor, read) -> None:
        """Fill this rank's shard of ``tensor`` (a DTensor or a whole tensor), reading only the keys of the rows
        it holds where the converter allows (``by_rows``), else all of this one parameter's keys."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        try:
            from torch.distributed.tensor.placement_types import _StridedShard
        except ImportError:  # pragma: no cover
            _StridedShard = Shard
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel() == 0:
            return
        rows = None
        if isinstance(tensor, DTensor):
            placements = list(tensor.placements)
            if self.by_rows():  # which rows (experts) this rank holds: its chunk of an index vector along dim 0
                on_rows = [isinstance(p, (Shard, _StridedShard)) and p.dim % tensor.ndim == 0 for p in placements]
                index = torch.arange(tensor.shape[0]).view(-1, *[1] * (tensor.ndim - 1))
                rows = local_chunk(index, tensor.device_mesh,
                                   [p if r else Replicate() for p, r in zip(placements, on_rows)]).flatten().tolist()
                placements = [Replicate() if r else p for p, r in zip(placements, on_rows)]
            value = local_chunk(self.assemble(read, rows)[self.target], tensor.device_mesh, placements)
        else:
            value = self.assemble(read)[self.target]
        if tuple(value.shape) != tuple(local.shape):
            raise RuntimeError(f"{self.target}: local shard {tuple(local.shape)} but the layout gives "
                               f"{tuple(value.shape)}")
        local.copy_(value)

"""Head-parallel gated delta-net (linear attention) layers: Qwen3-Next's ``linear_attn``.

transformers' plan gathers every projection of these layers (``colwise_gather_output`` on the input and output
projections), so each rank computes the whole layer on every head and the block moves three gathers forward
where Megatron's attention moves none. The layer is head-parallel like softmax attention, as Megatron and vLLM
run it: each rank keeps its key heads and the value heads they serve. What makes that possible here is the
layout of the fused input projections: ``in_proj_qkvz`` and ``in_proj_ba`` are grouped per key head
(``[q | k | v | z]`` of key head 0, then of key head 1, ...), so a plain row shard gives each rank the
projections of its own key heads and their value heads: ``colwise``. ``out_proj`` reads the value heads:
``rowwise``. ``A_log`` and ``dt_bias`` are per value head: sharded by rows too.

Two things torch's styles cannot say, written here (``HeadParallelDeltaNet``):

- The layer's own code sizes its reshapes from head counts it stores (``num_k_heads``, ``key_dim``, ...): each
  rank's layer holds 1/tp of the heads, so those attributes are divided.
- The depthwise convolution runs over the channels ``[q | k | v]`` of all heads; a rank's channels are three
  pieces of its weight (its q, k and v heads), of unequal size when there are more value heads than key heads,
  which no DTensor placement describes (``_StridedShard`` splits equal parts). The weight (``kernel`` values per
  channel, a few thousand numbers) stays whole on every rank as a replicated DTensor; each rank applies its
  channels' rows and the gradients, each nonzero on its own rows only, are summed over TP.

Qwen3.5's layers (``in_proj_qkv``: all query heads, then all key heads, then all value heads) have the same
unequal pieces in a large projection, where keeping the weight whole would defeat the sharding: they keep
transformers' plan (see docs/configuration.md).
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

STYLE = "delta_net_heads"
_HEAD_ATTRS = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


def _grouped_layer(module: nn.Module) -> bool:
    """A gated delta-net layer whose fused input projections are grouped per key head (Qwen3-Next's)."""
    needed = ("in_proj_qkvz", "in_proj_ba", "conv1d", "out_proj", "A_log", "dt_bias", *_HEAD_ATTRS,
              "head_k_dim", "head_v_dim")
    if not all(hasattr(module, a) for a in needed) or not isinstance(module.conv1d, nn.Conv1d):
        return False
    nk, nv, hk, hv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    return (nv % nk == 0 and module.in_proj_qkvz.out_features == 2 * nk * hk + 2 * nv * hv
            and module.in_proj_ba.out_features == 2 * nv and module.conv1d.weight.shape[0] == 2 * nk * hk + nv * hv
            and module.conv1d.groups == module.conv1d.weight.shape[0] and module.conv1d.bias is None
            and tuple(module.A_log.shape) == (nv,) and tuple(module.dt_bias.shape) == (nv,))


def delta_net_entries(model: nn.Module, tp_plan: dict[str, str], tp: int) -> dict[str, str]:
    """Head-parallel entries for the grouped gated delta-net layers whose input projection the plan gathers,
    when ``tp`` divides their key heads; nothing otherwise (the plan's gathered projections stay)."""
    gathered = [p for p, s in tp_plan.items() if s == "colwise_gather_output" and p.endswith(".in_proj_qkvz")]
    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if not any(fnmatch.fnmatchcase(f"{fqn}.in_proj_qkvz", p) for p in gathered) or not _grouped_layer(module):
            continue
        if tp < 2 or module.num_k_heads % tp:
            continue
        out.update({fqn: STYLE, f"{fqn}.in_proj_qkvz": "colwise", f"{fqn}.in_proj_ba": "colwise",
                    f"{fqn}.out_proj": "rowwise", f"{fqn}.A_log": "colwise", f"{fqn}.dt_bias": "colwise"})
    return out


def _channels(module: nn.Module, rank: int, tp: int) -> torch.Tensor:
    """The convolution channels of this rank's heads: its slice of q, of k and of v."""
    kd, vd = module.key_dim, module.value_dim  # before the division: whole-layer sizes
    pieces = [(0, kd), (kd, kd), (2 * kd, vd)]
    return torch.cat([torch.arange(start + rank * size // tp, start + (rank + 1) * size // tp)
                      for start, size in pieces])


class HeadParallelDeltaNet(ParallelStyle):
    """The layer itself (its projections get ``colwise``/``rowwise``, ``A_log``/``dt_bias`` a row shard): head
    counts divided by tp; forward runs on the local shards of its own parameters and on this rank's rows of the
    (replicated, gradient-summed) convolution weight."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from ..distributed.local_params import LocalWithSummedGrad, run_on_local_params

        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        rows = _channels(module, rank, tp)
        for attr in _HEAD_ATTRS:
            setattr(module, attr, getattr(module, attr) // tp)
        conv = module.conv1d
        weight = conv.weight
        if not isinstance(weight, DTensor):
            conv.register_parameter("weight", nn.Parameter(
                DTensor.from_local(weight, device_mesh, [Replicate()], run_check=False),
                requires_grad=weight.requires_grad))
        conv.groups = conv.in_channels = conv.out_channels = len(rows)
        inner = module.forward

        def forward(*args, **kwargs):  # the convolution is a child the layer's code reads directly: swapped here
            saved = dict(conv._parameters)
            try:
                w = saved["weight"]
                if isinstance(w, DTensor):
                    w = LocalWithSummedGrad.apply(w) if w.requires_grad else w.to_local()
                conv._parameters["weight"] = w[rows.to(w.device)]
                return inner(*args, **kwargs)
            finally:
                conv._parameters.update(saved)

        module.forward = forward
        run_on_local_params(module, device_mesh, replicate_plain=False)  # A_log, dt_bias: this rank's value heads
        return module


def delta_net_style(sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle:
    return HeadParallelDeltaNet()

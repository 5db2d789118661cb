"""Expert parallelism's token exchange: each (token, chosen expert) pair goes to the rank that holds the expert and
its output comes back, both with an all-to-all of variable splits that autograd differentiates.

The experts module's own forward (transformers' ``use_experts_implementation``: eager, batched or grouped matmul,
whatever the model chose) runs this rank's experts on the rows it received, with local expert ids, top-1 and unit
weights; the routing weights are applied where the token lives, in the same order one process applies them
(weighted outputs summed over the top-k slots), so routing and arithmetic are the model's own.

Why not transformers' ``AllToAllEP`` (``distributed/expert_parallel.py``), which does the same exchange: it needs a
``DeviceMesh`` for the ranks that hold the same tokens even where there are none (no tensor parallel) and reads the
owner of each expert from its own EP style. The exchange here takes process groups, so it runs on the expert view
of this package's mesh, whatever axes the view was carved from.

One host synchronisation per MoE layer (and per recomputation) remains: ``all_to_all_single`` takes its split sizes
on the host, and dropless routing makes them data-dependent. Avoiding it would mean padding every rank's send to
the worst case (all tokens to one rank), top_k times the memory and compute: not done.

On fake tensors (the dry run) the routing counts have no values: the split sizes are those of the routing the dry
run assumes (``interface.fake_values``: uniform, or all to one rank), and every tensor the real exchange makes is
made the same (the counts' all-to-all included), so only the sizes are assumed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import DTensor

from ...interface.fake_values import assumed, even_split, is_fake


class _SliceRows(torch.autograd.Function):
    """This rank's rows of a tensor every rank of ``group`` holds alike; backward gathers every rank's row
    gradients, so the gradient of the shared tensor is whole on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.sizes = group, _row_sizes(x.shape[0], group)
        return x.tensor_split(_bounds(ctx.sizes))[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.group, ctx.sizes), None


class _GatherRows(torch.autograd.Function):
    """Every rank's rows, concatenated in rank order; backward keeps this rank's rows' gradient."""

    @staticmethod
    def forward(ctx, x, group, total):
        ctx.group, ctx.sizes = group, _row_sizes(total, group)
        return _gather(x.contiguous(), group, ctx.sizes)

    @staticmethod
    def backward(ctx, grad):
        return grad.tensor_split(_bounds(ctx.sizes))[dist.get_rank(ctx.group)].contiguous(), None, None


def _row_sizes(total: int, group) -> list[int]:
    return even_split(total, dist.get_world_size(group))


def _bounds(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for s in sizes[:-1]:
        at += s
        out.append(at)
    return out


def _gather(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Rows of every rank (``sizes`` each, uneven allowed), padded to the largest for one all-gather."""
    most = max(sizes)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def assumed_sizes(pairs: int, ranks: int, rank: int) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each ep rank, rows it receives from each) under the dry run's routing
    (``fake_values.ROUTINGS`` words it), every ep rank holding ``pairs`` (token, expert) pairs as this one does:
    ``uniform`` splits each rank's pairs evenly over the ep ranks, ``all-to-one`` sends them all to ep rank 0."""
    if assumed().routing == "all-to-one":
        return [pairs] + [0] * (ranks - 1), [pairs if rank == 0 else 0] * ranks
    sent = even_split(pairs, ranks)
    return sent, [sent[rank]] * ranks


class ExpertDispatch:
    """The forward of an experts module whose experts are split over ``ep_group`` (rank r holds experts
    [r*L, (r+1)*L)), called as transformers calls an experts module: ``(hidden_states [T, H], top_k_index [T, K]
    global expert ids, top_k_weights [T, K])`` -> the weighted expert output per token [T, H].

    ``shared_group``: the ranks that hold these same tokens (tensor parallel outside its regions), or None; each
    of them sends a disjoint slice of the tokens and the outputs are gathered back, so every token reaches its
    experts once."""

    def __init__(self, experts, experts_forward, local_experts: int, ep_group, shared_group=None):
        self.experts = experts
        self.experts_forward = experts_forward  # the module's own forward, on local expert ids
        self.local_experts = local_experts
        self.ep_group = ep_group
        self.shared_group = shared_group

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if isinstance(hidden_states, DTensor):
            hidden_states = hidden_states.to_local()
        if isinstance(top_k_weights, DTensor):
            top_k_weights = top_k_weights.to_local()
        total = hidden_states.shape[0]
        if self.shared_group is not None:
            hidden_states = _SliceRows.apply(hidden_states, self.shared_group)
            top_k_weights = _SliceRows.apply(top_k_weights, self.shared_group)
            top_k_index = top_k_index.tensor_split(_bounds(_row_sizes(total, self.shared_group)))[
                dist.get_rank(self.shared_group)]
        output = self._exchange(hidden_states, top_k_index, top_k_weights)
        if self.shared_group is not None:
            output = _GatherRows.apply(output, self.shared_group, total)
        return output

    def _exchange(self, hidden_states, top_k_index, top_k_weights):
        tokens, top_k = top_k_index.shape
        ranks, local = dist.get_world_size(self.ep_group), self.local_experts
        expert_ids = top_k_index.reshape(-1)
        # sorted by expert, the pairs are grouped by the rank that owns their expert (contiguous ranges)
        order = torch.argsort(expert_ids, stable=True)
        fake = is_fake(expert_ids)  # a dry run's: no counts to read, the assumed routing's sizes instead
        send_counts = expert_ids.new_empty(ranks * local) if fake else torch.bincount(expert_ids,
                                                                                      minlength=ranks * local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        # the layer's one host synchronisation: the split sizes, both ways, in one transfer
        sizes = torch.stack([send_counts.view(ranks, local).sum(1), recv_counts.view(ranks, local).sum(1)])
        send_sizes, recv_sizes = (assumed_sizes(tokens * top_k, ranks, dist.get_rank(self.ep_group)) if fake
                                  else sizes.tolist())
        received = wait_tensor(all_to_all_single_autograd(hidden_states[order // top_k], recv_sizes, send_sizes,
                                                          self.ep_group))
        # from each source rank, its rows for this rank's experts 0..L-1 in order
        local_ids = torch.arange(local, device=received.device).repeat(ranks).repeat_interleave(
            recv_counts, output_size=received.shape[0])
        if received.shape[0] == 0:
            # no rows for this rank's experts: run them on one zero row that stays in the graph, so their
            # gradients exist (zero) and every rank's data-parallel reduction of them runs
            out = self._run(received.sum(0, keepdim=True), local_ids.new_zeros(1))[:0]
        else:
            out = self._run(received, local_ids)
        back = wait_tensor(all_to_all_single_autograd(out, send_sizes, recv_sizes, self.ep_group))
        per_slot = back[torch.argsort(order)].view(tokens, top_k, -1)  # back in (token, slot) order
        return (per_slot * top_k_weights.unsqueeze(-1).to(per_slot.dtype)).sum(dim=1).to(hidden_states.dtype)

    def _run(self, rows, local_ids):
        """This rank's experts on ``rows``, each row to one expert with weight 1, on the local values of the
        experts' parameters (DTensors over the expert axis; FSDP2 gathers them over its own axes first)."""
        saved = [(owner, name, param) for owner in self.experts.modules()
                 for name, param in owner._parameters.items() if isinstance(param, DTensor)]
        try:
            for owner, name, param in saved:
                owner._parameters[name] = param.to_local()
            weights = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            return self.experts_forward(rows, local_ids.unsqueeze(-1), weights)
        finally:
            for owner, name, param in saved:
                owner._parameters[name] = param

"""Context-parallel attention functions against unsplit attention, forward and backward, on every rank of a
torchrun launch (gloo): ring and Ulysses; multi-head, grouped-query and multi-query heads; plain causal, packed
documents, a sliding window within documents, soft-capping, attention sinks (their gradient summed over ranks). Rank 0 writes the largest difference as JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/cp_attention_worker.py OUT.json
"""
import json
import sys

import torch
import torch.distributed as dist

from ultrascale_plugins.dims.cp_attention import CPState, cp_attention
from ultrascale_plugins.dims.cp_layout import local_index, segments, visible


class Attention(torch.nn.Module):  # what transformers passes as ``module``
    is_causal = True


def unsplit(q, k, v, positions, documents, window, softcap, scale, sinks=None):
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    index = torch.arange(q.shape[2])
    seg = segments(positions) if documents else None
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible(index, index, seg, seg, window), float("-inf"))
    if sinks is not None:  # transformers' eager rule: a sink logit per head joins the softmax, then is dropped
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, -1)[..., :q.shape[2]]
    return (p @ v).transpose(1, 2)


def main():
    from ultrascale_plugins.dims import cp_attention as kernels

    kernels.TILE = 3  # several tiles per chunk, uneven ones too: the tiled ring must equal the untiled one
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    worst, cases = 0.0, 0
    batch, seq, dim = 2, 32, 8
    for method in ("ring", "ulysses"):
        for heads, kv_heads in ((4, 2), (8, 8), (4, 1)):
            for documents, window, softcap, sink in ((False, None, None, False), (True, None, None, False),
                                                     (True, 5, None, False), (False, None, 30.0, False),
                                                     (True, 7, None, True)):
                torch.manual_seed(cases)
                q = torch.randn(batch, heads, seq, dim, requires_grad=True)
                k = torch.randn(batch, kv_heads, seq, dim, requires_grad=True)
                v = torch.randn(batch, kv_heads, seq, dim, requires_grad=True)
                positions = torch.arange(seq).expand(batch, seq).clone()
                if documents:  # row 0: two documents, row 1: three
                    positions[0, 10:] -= 10
                    positions[1, 20:] -= 20
                    positions[1, 25:] -= 5
                grad = torch.randn(batch, seq, heads, dim)
                scale = dim ** -0.5
                sinks = torch.randn(heads, requires_grad=True) if sink else None
                want = unsplit(q, k, v, positions, documents, window, softcap, scale, sinks)
                (want * grad).sum().backward()
                index = local_index(seq, cp, rank)
                mine = [t.detach()[:, :, index].clone().requires_grad_() for t in (q, k, v)]
                state = CPState(dist.group.WORLD, cp, rank, method)
                state.document_mask = documents
                kwargs = {"position_ids": positions[:, index]}
                if window:
                    kwargs["sliding_window"] = window
                if softcap:
                    kwargs["softcap"] = softcap
                if sink:
                    kwargs["s_aux"] = my_sinks = sinks.detach().clone().requires_grad_()
                out, _ = cp_attention(state, Attention(), *mine, None, scaling=scale, **kwargs)
                (out * grad[:, index]).sum().backward()
                diffs = [(out - want.detach()[:, index]).abs().max()] + [
                    (m.grad - t.grad[:, :, index]).abs().max() for m, t in zip(mine, (q, k, v))]
                if sink:  # each rank's share of the sinks' gradient, summed over the ranks
                    total = my_sinks.grad.clone()
                    dist.all_reduce(total)
                    diffs.append((total - sinks.grad).abs().max())
                worst = max(worst, *(float(d) for d in diffs))
                cases += 1
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"max_diff": worst, "cases": cases}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Context-parallel attention functions against unsplit attention, forward and backward, on every rank of a
torchrun launch (gloo): ring and Ulysses; multi-head, grouped-query and multi-query heads; plain causal, packed
documents, a sliding window within documents, soft-capping, attention sinks (their gradient summed over ranks);
on the CPU SDPA kernel (the default) and on the portable path, and in bf16. Rank 0 writes the largest differences
and how many blocks the SDPA kernel computed, as JSON.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/cp_attention_worker.py OUT.json
"""
import json
import sys

import torch
import torch.distributed as dist

from ultrascale_plugins.dims.context.attention import CPState, cp_attention
from ultrascale_plugins.dims.context.layout import local_index, segments, visible


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


def run_case(method, heads, kv_heads, documents, window, softcap, sink, seed, dtype=torch.float32):
    """One case on this rank: (largest differences against unsplit fp32 attention of the same (rounded) inputs,
    each divided by the largest reference value when ``dtype`` is not fp32)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    batch, seq, dim = 2, 32, 8
    torch.manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim).to(dtype).float().requires_grad_()
    k = torch.randn(batch, kv_heads, seq, dim).to(dtype).float().requires_grad_()
    v = torch.randn(batch, kv_heads, seq, dim).to(dtype).float().requires_grad_()
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
    mine = [t.detach()[:, :, index].to(dtype).clone().requires_grad_() for t in (q, k, v)]
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
    assert out.dtype == dtype, (out.dtype, dtype)
    (out.float() * grad[:, index]).sum().backward()
    pairs = [(out, want[:, index])] + [(m.grad, t.grad[:, :, index]) for m, t in zip(mine, (q, k, v))]
    if sink:  # each rank's share of the sinks' gradient, summed over the ranks
        total = my_sinks.grad.clone()
        dist.all_reduce(total)
        pairs.append((total, sinks.grad))
    relative = dtype != torch.float32
    return [float((a.detach().float() - b.detach()).abs().max() / (b.detach().abs().max() if relative else 1))
            for a, b in pairs]


def main():
    from ultrascale_plugins.dims.context import attention
    from ultrascale_plugins.dims.context import kernels as cp_kernels

    attention.TILE = 3  # several tiles per chunk, uneven ones too: the tiled ring must equal the untiled one
    calls = {"kernel": 0}
    block_forward = cp_kernels.block_forward

    def counted(*args, **kwargs):  # which path ran: the SDPA kernel's or the portable one
        calls["kernel"] += 1
        return block_forward(*args, **kwargs)

    cp_kernels.block_forward = counted
    dist.init_process_group("gloo")
    result = {"max_diff": {}, "kernel_blocks": {}, "cases": 0}
    for setting in ("auto", "portable"):  # the CPU SDPA kernel (the default), and the portable fp32 path
        cp_kernels.KERNEL = setting
        calls["kernel"] = worst = cases = 0
        for method in ("ring", "ulysses"):
            for heads, kv_heads in ((4, 2), (8, 8), (4, 1)):
                for documents, window, softcap, sink in ((False, None, None, False), (True, None, None, False),
                                                         (True, 5, None, False), (False, None, 30.0, False),
                                                         (True, 7, None, True)):
                    diffs = run_case(method, heads, kv_heads, documents, window, softcap, sink, cases)
                    worst = max(worst, *diffs)
                    cases += 1
        result["max_diff"][setting], result["kernel_blocks"][setting] = worst, calls["kernel"]
        result["cases"] += cases
    cp_kernels.KERNEL = "auto"
    worst = 0.0  # bf16 inputs run the kernels in bf16: differences relative to the largest reference value
    for method in ("ring", "ulysses"):
        for documents, window in ((False, None), (True, 5)):
            worst = max(worst, *run_case(method, 4, 2, documents, window, None, False, 100, torch.bfloat16))
    result["bf16_max_rel"] = worst
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

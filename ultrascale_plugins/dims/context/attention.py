"""Context-parallel attention: ring attention and Ulysses, as transformers attention functions.

Both are registered in transformers' ``AttentionInterface`` and selected on the model's config, so every
architecture whose attention goes through that interface runs them unchanged. They get this rank's queries, keys
and values for its head-tail shard of the sequence (``cp_layout``) and the shard's global ``position_ids``, and
build the mask themselves from global indices: causal, within one document for packed rows (positions that
restart), within the sliding window when the layer has one. Right padding needs no mask: it comes after every
real token, so causality hides it.

Why not PyTorch's own context parallel (``torch.distributed.tensor.experimental.context_parallel``, torch 2.13)?
It patches ``F.scaled_dot_product_attention`` only, routes only the flash / efficient / cuDNN SDPA kernels (none
exists for CPU: it raises there), refuses any attention mask (padding, documents, windows) and soft-capping. So the
ring is written here with point-to-point sends (``batch_isend_irecv``: works on gloo and NCCL), with an exact
backward that sends the key/value gradients round the ring to their owners.

- **ring**: keys and values travel round the cp ranks; each step attends this rank's queries to the visiting
  block (only the chunk pairs causality allows) and merges the partial result by its log-sum-exp. Blocks run on
  PyTorch's SDPA kernels in the input dtype (``cp_kernels``: flash for CPU; flash, memory-efficient or cuDNN on
  CUDA), or on a portable fp32 matmul path where none applies (soft-capping). Activation memory per rank is that
  of ``S / cp`` tokens: only the local queries, keys, values, output and log-sum-exp are kept for backward, which
  recomputes each block's probabilities.
- **ulysses**: an all-to-all turns (all heads, S/cp tokens) into (heads/cp, all S tokens), attention runs over the
  whole sequence for those heads (``F.scaled_dot_product_attention(is_causal=True)`` when plain causal: flash
  kernels on CUDA; the exact block kernel with documents, windows, soft-capping), and a second all-to-all turns it
  back. Key/value heads that do not split over cp are replicated first.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...interface.config import ConfigError
from ...interface.fake_values import is_fake
from . import kernels as cp_kernels
from .layout import chunk_ids, layout_index, local_index, segments, visible

# kwargs the attention functions understand; any other tensor argument changes attention in a way they don't know
KNOWN_KWARGS = {"position_ids", "sliding_window", "softcap", "s_aux", "dropout", "scaling", "use_cache", "is_causal",
                "output_attentions", "cache_position", "past_key_values", "past_key_value", "layer_idx",
                "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "head_mask", "token_type_ids"}
REFUSED_KWARGS = {"position_bias": "a relative position bias",
                  "alibi": "ALiBi position biases", "attention_bias": "an additive attention bias"}


@dataclasses.dataclass
class CPState:
    """One model's context-parallel group and the per-batch flag the attention functions read."""

    group: object
    size: int
    rank: int
    method: str
    document_mask: bool = True  # set per batch by shard_batch: packed documents count only without a mask
    name: str = ""  # its registered attention-function name
    kernel: str = "auto"  # the layout's cp_kernel: "auto" (cp_kernels.KERNEL decides) or "portable"

    def __post_init__(self):
        self.next_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.size)


# ---- one block of attention, its partial result and the merge ------------------------------------------------
def block_scores(q, k, scale: float, softcap: float | None):
    """(B, H, Lq, Lk) fp32 scores, and tanh(s / softcap) for the backward when soft-capped."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def block_attention(q, k, v, mask, scale: float, softcap: float | None = None):
    """Attention of ``q`` to one block of keys, unnormalised-merge ready: (normalised output, log-sum-exp).
    Rows that see no key of the block give output 0 and log-sum-exp -inf (they vanish in the merge)."""
    s, _ = block_scores(q, k, scale, softcap)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v) / total.clamp_min(torch.finfo(total.dtype).tiny)
    lse = (m + torch.log(total)).squeeze(-1)  # -inf where nothing is visible
    return out, lse


def merge(out, lse, block_out, block_lse):
    """Combine two partial attention results over disjoint key sets by their log-sum-exps (exact)."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    a = torch.exp(lse - safe).unsqueeze(-1)
    b = torch.exp(block_lse - safe).unsqueeze(-1)
    return a * out + b * block_out, new


def repeat_heads(x, n: int):
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def fold_heads(x, n: int):
    """Sum a gradient over the query heads that shared one key/value head."""
    if n == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // n, n, s, d).sum(2)


# ---- the ring ------------------------------------------------------------------------------------------------
TILE = 1024  # query x key tokens per block of scores (transient memory: heads x TILE x TILE floats)


@dataclasses.dataclass
class RingPlan:
    """What every step of the ring needs besides the tensors: the chunks, the masks' inputs, the scale."""

    state: CPState
    chunk: int
    q_index: torch.Tensor  # (L,) global index of each local token
    seg: torch.Tensor | None  # (B, S) document of every global token, or None
    window: int | None
    scale: float
    softcap: float | None
    n_rep: int
    kernel: str = "portable"  # cp_kernels.ring_kernel's choice: "portable", "auto" or a forced SDPA kernel
    sinks: bool = False  # attention sinks: the backward is portable (RingAttention.backward), so tile for it

    def blocks(self, src: int):
        """(query rows, key rows of the visiting block, mask, causal) for each tile of this rank's query chunks
        against the block's key chunks that causality (and the window) leave visible; tiles wholly above the
        diagonal or outside the window are skipped. The portable path gets every tile's bool mask and tiles of at
        most ``TILE`` x ``TILE`` tokens, which bound its transient scores (the saved activations are the shard's
        q, k, v, output and log-sum-exp whatever the tile). The SDPA kernels tile internally: they get mask None
        for tiles wholly visible and ``causal`` True for square diagonal tiles of plain causal attention, and with
        no documents and no window one tile per chunk pair (no mask at all)."""
        c, cp = self.chunk, self.state.size
        portable = self.kernel == "portable"
        plain = self.seg is None
        tile = c if plain and self.window is None and not portable and not self.sinks else TILE
        out = []
        for qi, q_chunk in enumerate(chunk_ids(cp, self.state.rank)):
            for ki, k_chunk in enumerate(chunk_ids(cp, src)):
                if k_chunk > q_chunk:
                    continue
                for qa in range(0, c, tile):
                    q_rows = slice(qi * c + qa, qi * c + min(c, qa + tile))
                    q_first, q_last = q_chunk * c + qa, q_chunk * c + min(c, qa + tile) - 1
                    for ka in range(0, c, tile):
                        k_first, k_last = k_chunk * c + ka, k_chunk * c + min(c, ka + tile) - 1
                        if k_first > q_last or (self.window is not None and q_first - k_last >= self.window):
                            continue
                        k_rows = slice(ki * c + ka, ki * c + min(c, ka + tile))
                        in_window = self.window is None or q_last - k_first < self.window
                        if plain and in_window and not portable and k_last <= q_first:
                            out.append((q_rows, k_rows, None, False))  # every query sees every key
                            continue
                        if plain and in_window and not portable and (q_first, q_last) == (k_first, k_last):
                            out.append((q_rows, k_rows, None, True))  # plain causal, aligned on the diagonal
                            continue
                        q_idx = self.q_index[q_rows]
                        k_idx = torch.arange(k_first, k_last + 1, device=q_idx.device)
                        q_seg = k_seg = None
                        if self.seg is not None:
                            q_seg, k_seg = self.seg[:, q_idx], self.seg[:, k_idx]
                        out.append((q_rows, k_rows, visible(q_idx, k_idx, q_seg, k_seg, self.window), False))
        return out


def _exchange(send: torch.Tensor, state: CPState):
    """Start sending ``send`` to the next rank and receiving the previous rank's into a new buffer."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, state.next_peer, group=state.group),
           dist.P2POp(dist.irecv, recv, state.prev_peer, group=state.group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def _visiting(kv, dk: int, plan: RingPlan, portable: bool):
    """The visiting block's keys and values, their heads repeated for grouped queries: fp32 for the portable
    path, the input dtype (contiguous, as the CUDA kernels load aligned rows) for the SDPA kernels."""
    k, v = repeat_heads(kv[..., :dk], plan.n_rep), repeat_heads(kv[..., dk:], plan.n_rep)
    return (k.float(), v.float()) if portable else (k.contiguous(), v.contiguous())


def _portable_block_backward(q, k, v, grad_out, mask, lse, delta, plan: RingPlan):
    """(dq, dk, dv) in fp32 of one block by matmul: P recomputed from the final log-sum-exp."""
    s, t = block_scores(q, k, plan.scale, plan.softcap)
    p = torch.exp(s.masked_fill(~mask, float("-inf")) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), grad_out)
    ds = p * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta)
    if t is not None:
        ds = ds * (1 - t * t)
    return torch.matmul(ds, k) * plan.scale, torch.matmul(ds.transpose(-1, -2), q) * plan.scale, dv


class RingAttention(torch.autograd.Function):
    """Exact causal ring attention over the cp group: q (B, H, L, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv) of
    this rank's shard -> output (B, H, L, Dv) in q's dtype and its log-sum-exp (B, H, L) in fp32, both
    differentiable (attention sinks rescale the output by the log-sum-exp). Blocks run on the SDPA kernel
    ``plan.kernel`` chose (``cp_kernels``), in the input dtype, or on the portable fp32 matmul path."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        ctx.set_materialize_grads(False)  # grad_lse stays None unless the log-sum-exp is used (sinks)
        cp, rank = plan.state.size, plan.state.rank
        portable = plan.kernel == "portable"
        qc = q.float() if portable else q
        # the merge accumulates in fp32 whatever the input dtype: a row's output is rescaled and summed over up to
        # 2cp+1 blocks (more with tiles), and bf16 would round at each of them; only the result is kept
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=-1).contiguous()
        aux = {}  # each kernel's RNG state from its forward, which its backward takes (unused without dropout)
        for step in range(cp):
            src = (rank - step) % cp
            nxt, works = _exchange(kv, plan.state) if step < cp - 1 else (None, [])
            kc, vc = _visiting(kv, k.shape[-1], plan, portable)
            for q_rows, k_rows, mask, causal in plan.blocks(src):
                if portable:
                    o, l_ = block_attention(qc[:, :, q_rows], kc[:, :, k_rows], vc[:, :, k_rows], mask, plan.scale,
                                            plan.softcap)
                else:
                    name = cp_kernels.block_kernel(plan.kernel, q, v, mask is not None)
                    o, l_, aux[name] = cp_kernels.block_forward(name, q[:, :, q_rows], kc[:, :, k_rows],
                                                                vc[:, :, k_rows], mask, causal, plan.scale)
                out[:, :, q_rows], lse[:, :, q_rows] = merge(out[:, :, q_rows], lse[:, :, q_rows], o, l_)
            _wait(works)
            kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # out in the input dtype, lse in fp32
        ctx.plan, ctx.aux = plan, aux
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        cp, rank = plan.state.size, plan.state.rank
        dk_dim = k.shape[-1]
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        # The SDPA backward kernels compute delta = rowsum(dO * O) themselves and have no input for the
        # log-sum-exp's own gradient (attention sinks: d lse / d s = P, so it enters as delta - grad_lse); those
        # calls take the portable backward, which works from any forward's output and log-sum-exp.
        portable = plan.kernel == "portable" or grad_lse is not None
        if portable:
            qc, do = q.float(), grad_out.float()
            delta = (do * out.float()).sum(-1, keepdim=True)
            if grad_lse is not None:
                delta = delta - grad_lse.unsqueeze(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat([k, v], dim=-1).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # travels with its block
        for step in range(cp):
            src = (rank - step) % cp
            nxt, works = _exchange(kv, plan.state) if step < cp - 1 else (None, [])
            kc, vc = _visiting(kv, dk_dim, plan, portable)
            dkc = torch.zeros(kc.shape, dtype=torch.float32, device=kc.device)
            dvc = torch.zeros(vc.shape, dtype=torch.float32, device=vc.device)
            for q_rows, k_rows, mask, causal in plan.blocks(src):
                if portable:
                    if mask is None:  # a kernel plan's tile (sinks): the portable path needs the bool mask
                        mask = _tile_mask(plan, q_rows, k_rows, causal)
                    grads = _portable_block_backward(qc[:, :, q_rows], kc[:, :, k_rows], vc[:, :, k_rows],
                                                     do[:, :, q_rows], mask, lse[:, :, q_rows],
                                                     delta[:, :, q_rows], plan)
                else:
                    name = cp_kernels.block_kernel(plan.kernel, q, v, mask is not None)
                    grads = cp_kernels.block_backward(name, grad_out[:, :, q_rows], q[:, :, q_rows],
                                                      kc[:, :, k_rows], vc[:, :, k_rows], out[:, :, q_rows],
                                                      lse[:, :, q_rows], mask, causal, plan.scale, ctx.aux[name])
                dq[:, :, q_rows] += grads[0]  # accumulated in fp32 over the blocks, whatever the kernel's dtype
                dkc[:, :, k_rows] += grads[1]
                dvc[:, :, k_rows] += grads[2]
            dkv += torch.cat([fold_heads(dkc, plan.n_rep), fold_heads(dvc, plan.n_rep)], dim=-1)
            _wait(works)
            # the block and its gradient so far move on together; after the last step the gradient goes home
            if cp > 1:
                received, works = _exchange(dkv, plan.state)
                _wait(works)  # dkv (the send buffer) stays referenced until the send completes
                dkv = received
            kv = nxt
        return dq.to(q.dtype), dkv[..., :dk_dim].to(k.dtype), dkv[..., dk_dim:].to(v.dtype), None


def _tile_mask(plan: RingPlan, q_rows: slice, k_rows: slice, causal: bool):
    """The bool mask of a tile the kernel plan left unmasked: all visible, or causal on the diagonal."""
    lq, lk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
    mask = torch.ones(lq, lk, dtype=torch.bool, device=plan.q_index.device)
    return (mask.tril() if causal else mask)[None, None]


# ---- Ulysses -------------------------------------------------------------------------------------------------
class AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 of a contiguous tensor; its own transpose, so backward is the same."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x's strides were
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x, state: CPState):
    """(B, H, L, D) sequence shard -> (B, H/cp, cp*L, D) all tokens (rank order) for this rank's heads."""
    b, h, length, d = x.shape
    cp = state.size
    x = x.reshape(b, cp, h // cp, length, d).permute(1, 0, 2, 3, 4).contiguous()
    x = AllToAll.apply(x, state.group)  # dim 0 now: the source rank of the tokens
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * length, d)


def heads_to_seq(x, state: CPState):
    """Inverse of ``seq_to_heads``."""
    b, hl, total, d = x.shape
    cp = state.size
    x = x.reshape(b, hl, cp, total // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    x = AllToAll.apply(x, state.group)  # dim 0 now: the rank whose heads these are
    return x.permute(1, 0, 2, 3, 4).reshape(b, cp * hl, total // cp, d)


@dataclasses.dataclass
class _Whole:
    """The ring kernel's view of a sequence held whole by one rank (Ulysses, after its all-to-all)."""

    size: int = 1
    rank: int = 0


def with_sinks(out, lse, sinks):
    """Attention sinks (GPT-OSS): one extra logit per head that joins the softmax's denominator and carries no
    value, i.e. the output scaled by exp(lse) / (exp(lse) + exp(sink))."""
    if sinks is None:
        return out
    total = torch.logaddexp(lse, sinks.float()[None, :, None])
    return (out.float() * torch.exp(lse - total).unsqueeze(-1)).to(out.dtype)


def whole_sequence_attention(q, k, v, seg, window, scale: float, softcap: float | None, sinks=None,
                             kernel: str | None = None):
    """Causal attention over a whole sequence in global order (B, H, S, D), k/v with H heads. Plain causal
    attention goes to ``F.scaled_dot_product_attention(is_causal=True)`` (flash kernels on CUDA, the flash CPU
    kernel here: no S x S mask or scores are kept); documents, windows, soft-capping and sinks go to the ring's
    block kernel on one rank, which keeps only q, k, v, the output and its log-sum-exp for backward."""
    if seg is None and window is None and not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    total = q.shape[2]
    plan = RingPlan(_Whole(), total // 2, torch.arange(total, device=q.device), seg, window, scale, softcap, 1,
                    cp_kernels.ring_kernel(q, v, softcap, kernel), sinks is not None)
    return with_sinks(*RingAttention.apply(q, k, v, plan), sinks)


def kv_replication(h_local: int, kv_local: int, cp: int) -> int:
    """How many times to repeat each key/value head so they split over ``cp`` like the query heads."""
    n_rep = h_local // kv_local
    need = cp // math.gcd(cp, kv_local)
    if h_local % cp or n_rep % need:
        raise ConfigError(f"cp={cp} with cp_method=ulysses: this rank's {h_local} attention heads do not split over "
                          f"cp. Fix: use cp_method: ring, or a cp that divides the heads per tensor-parallel rank")
    return need


# ---- the functions transformers calls ------------------------------------------------------------------------
def unsupported_kwargs(kwargs: dict) -> list[str]:
    """The attention arguments these functions do not implement: the refused ones, and unknown tensors."""
    return [name for name, value in kwargs.items()
            if name in REFUSED_KWARGS or (name not in KNOWN_KWARGS and isinstance(value, torch.Tensor))]


def _global_positions(position_ids, state: CPState, rows: int, index: torch.Tensor) -> torch.Tensor:
    """All-gather the shards' positions and put them in global order (``index``: the rank-order tokens' global
    indices): (B, S)."""
    local = position_ids.expand(rows, -1).contiguous()
    parts = [torch.empty_like(local) for _ in range(state.size)]
    dist.all_gather(parts, local, group=state.group)
    out = torch.empty(rows, index.numel(), dtype=local.dtype, device=local.device)
    out[:, index] = torch.cat(parts, dim=1)
    return out


def _check_call(module, attention_mask, dropout, kwargs) -> None:
    if attention_mask is not None:
        raise ConfigError(f"context parallel: {type(module).__name__} received an attention mask built by the model "
                          "for the local shard; context parallel builds its own from global positions. Fix: cp: 1 "
                          "for this model")
    if dropout:
        raise ConfigError(f"context parallel: attention dropout {dropout} is not supported. Fix: set the model's "
                          "attention dropout to 0")
    for name in unsupported_kwargs(kwargs):
        raise ConfigError(f"context parallel: {type(module).__name__} passes '{name}' "
                          f"({REFUSED_KWARGS.get(name, 'an unknown tensor')}) to its attention, which context "
                          "parallel does not implement. Fix: cp: 1 for this model")
    if kwargs.get("position_ids") is None:
        raise ConfigError(f"context parallel: {type(module).__name__} does not pass position_ids to its attention "
                          "function, so the shards' global positions are unknown. Fix: cp: 1 for this model")


def _setting(state: CPState) -> str | None:
    """The layout's choice: ``portable``, or None for ``cp_kernels.KERNEL`` (``auto`` unless a check forces one)."""
    return "portable" if state.kernel == "portable" else None


# Not traced by torch.compile: the ring's point-to-point sends, the all-to-alls and the autograd.Function's
# Python loop over blocks (shapes and kernel choices decided in Python) run eagerly, as a graph break inside a
# compiled decoder layer; the projections around attention still compile.
@torch.compiler.disable
def cp_attention(state: CPState, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered in transformers' AttentionInterface: (B, H, L, D) shards in, (B, L, H, Dv) out."""
    _check_call(module, attention_mask, dropout, kwargs)
    rows, heads, length, _ = query.shape
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    if sinks is not None and hasattr(sinks, "to_local"):  # a DTensor parameter (tensor parallel): this rank's heads
        sinks = sinks.to_local()
    total = length * state.size
    index = layout_index(total, state.size, query.device)  # global index of each token, in rank order
    positions = _global_positions(kwargs["position_ids"], state, rows, index)
    seg = segments(positions) if state.document_mask else None
    # no row restarts: plain causal (as transformers); a dry run's rows hold one sequence each, so on fake
    # tensors that is the answer (interface.fake_values)
    if seg is not None and (is_fake(seg) or not bool((seg[:, -1] != 0).any())):
        seg = None
    if state.method == "ring":
        plan = RingPlan(state, total // (2 * state.size), local_index(total, state.size, state.rank, query.device),
                        seg, window, scale, softcap, heads // key.shape[1],
                        cp_kernels.ring_kernel(query, value, softcap, _setting(state)), sinks is not None)
        out = with_sinks(*RingAttention.apply(query, key, value, plan), sinks)
    else:
        rep = kv_replication(heads, key.shape[1], state.size)
        q = seq_to_heads(query, state)
        k = seq_to_heads(repeat_heads(key, rep), state)
        v = seq_to_heads(repeat_heads(value, rep), state)
        n_rep = q.shape[1] // k.shape[1]
        order = torch.argsort(index)  # rank order -> global order
        q, k, v = (t.index_select(2, order) for t in (q, repeat_heads(k, n_rep), repeat_heads(v, n_rep)))
        if sinks is not None:  # this rank's heads after the all-to-all
            sinks = sinks[state.rank * q.shape[1]:(state.rank + 1) * q.shape[1]]
        out = whole_sequence_attention(q, k, v, seg, window, scale, softcap, sinks, _setting(state))
        out = heads_to_seq(out.index_select(2, index), state)
    return out.transpose(1, 2).contiguous(), None

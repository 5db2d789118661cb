"""A block of attention by one of PyTorch's SDPA kernels: forward (out, log-sum-exp) and backward (dq, dk, dv).

The ring (``cp_attention``) attends its queries to one block of keys at a time and merges the partial results by
their log-sum-exp, so it needs kernels that return the log-sum-exp and whose backward takes it back. PyTorch has
four, called here through their aten ops (their public wrapper, ``F.scaled_dot_product_attention``, returns the
output only):

- ``flash_cpu``: ``_scaled_dot_product_flash_attention_for_cpu`` — any float dtype, a float additive mask of the
  query's dtype (a bool mask is refused), queries and values of the same head size.
- ``flash`` (CUDA): fp16/bf16, no mask (``is_causal`` only).
- ``efficient`` (CUDA): any float dtype, an additive bias. Its log-sum-exp is padded along the queries to a
  multiple of 32 (except on ROCm): sliced here after the forward, padded again for the backward.
- ``cudnn`` (CUDA): fp16/bf16, an additive bias; its log-sum-exp has a trailing dimension of 1.

Every call sees one block: ``mask`` None (every key visible), ``causal`` True (a square block on the diagonal,
whose first query and first key are the same global token: top-left and bottom-right alignment agree there), or a
bool ``mask`` (B or 1, 1, Lq, Lk). The backward is given the *final* output and log-sum-exp of the rows (merged over
all blocks), as ring flash attention does: the kernel then computes P = exp(S - lse_final) and
delta = rowsum(dO * O_final), i.e. exactly this block's share of the gradient.

``KERNEL`` picks the kernel: ``auto`` (by device: ``flash_cpu`` on CPU; ``flash`` on CUDA for blocks without a
mask in fp16/bf16, else ``efficient``), ``portable`` (the ring's matmul + softmax in fp32, as before these kernels),
or one kernel by name, so a check can run each.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

KERNELS = ("flash_cpu", "flash", "efficient", "cudnn")
SETTINGS = ("auto", "portable", *KERNELS)
KERNEL = "auto"  # the ring's choice; read at each call, so tests and benchmarks may set it

_CUDA_HALF = (torch.float16, torch.bfloat16)


def _head_dims_ok(kernel: str, q, v) -> bool:
    d, dv = q.shape[-1], v.shape[-1]
    if kernel == "flash_cpu":
        return d == dv
    if kernel == "flash":
        return d == dv and d % 8 == 0 and d <= 256
    align = 4 if q.dtype == torch.float32 else 8  # the efficient kernel's memory alignment, in elements
    return d % align == 0 and dv % align == 0 and (kernel != "cudnn" or (d <= 128 and dv <= 128))


def ring_kernel(q, v, softcap, setting: str | None = None) -> str:
    """The kernel setting for a whole ring call: ``portable`` where no SDPA kernel can run it, else ``auto`` or a
    forced kernel name (then ``block_kernel`` picks per block). Soft-capping has no SDPA kernel (tanh of the
    scores inside the softmax), so soft-capped models (Gemma 2) stay portable."""
    setting = KERNEL if setting is None else setting
    if setting not in SETTINGS:
        raise ValueError(f"cp_kernels.KERNEL={setting!r} is not a kernel setting. Fix: one of {', '.join(SETTINGS)}")
    if softcap or setting == "portable":
        return "portable"
    device = q.device.type
    if setting != "auto":
        wanted = "cpu" if setting == "flash_cpu" else "cuda"
        if device != wanted:
            raise ValueError(f"cp_kernels.KERNEL={setting!r} runs on {wanted}, but the attention runs on {device}. "
                             "Fix: KERNEL='auto'")
        if setting in ("flash", "cudnn") and q.dtype not in _CUDA_HALF:
            raise ValueError(f"cp_kernels.KERNEL={setting!r} takes fp16/bf16 only, got {q.dtype}. Fix: "
                             "KERNEL='efficient' or 'auto'")
        return setting
    if device == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "auto" if _head_dims_ok("flash_cpu", q, v) else "portable"
    if device == "cuda" and q.dtype in (torch.float32, *_CUDA_HALF) and _head_dims_ok("efficient", q, v):
        return "auto"
    return "portable"  # other devices, or head sizes no kernel takes


def block_kernel(setting: str, q, v, masked: bool) -> str:
    """The kernel for one block under ``setting`` (``auto`` or a forced name, from ``ring_kernel``)."""
    if setting == "auto":
        if q.device.type == "cpu":
            return "flash_cpu"
        return "flash" if not masked and q.dtype in _CUDA_HALF and _head_dims_ok("flash", q, v) else "efficient"
    if setting == "flash" and masked:
        raise ValueError("cp_kernels.KERNEL='flash': this block needs a mask (documents or a sliding window) and "
                         "the flash kernel takes none. Fix: KERNEL='auto', 'efficient' or 'cudnn'")
    return setting


def additive_mask(mask, q, heads: int):
    """The bool mask as the additive float mask the kernels take, in the query's dtype: 0 where visible, -inf
    elsewhere. For the CUDA kernels the rows are allocated padded to 16 keys and sliced (their loads need aligned
    rows, as F.scaled_dot_product_attention does), and batch and heads are expanded (stride 0, no copy)."""
    if mask is None:
        return None
    b, _, lq, lk = mask.shape
    width = lk if q.device.type == "cpu" else -(-lk // 16) * 16
    bias = torch.zeros(b, 1, lq, width, dtype=q.dtype, device=q.device)[..., :lk]
    bias.masked_fill_(~mask, float("-inf"))
    if q.device.type == "cpu":
        return bias
    return bias.expand(q.shape[0], heads, lq, lk)


def _lse_width(kernel: str, rows: int) -> int:
    if kernel == "efficient" and not torch.version.hip:
        return -(-rows // 32) * 32
    return rows


def _bhld_as_blhd(x):
    """Same values, stored (B, L, H, D): the layout the efficient kernel's own forward gives its output and that
    its backward expects of ``out`` and ``grad_out`` (pytorch/pytorch#138772)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def block_forward(kernel: str, q, k, v, mask, causal: bool, scale: float):
    """(out in q's dtype, lse fp32 (B, H, Lq), aux for the backward) of ``q`` attending to one block. Rows that
    see no key of the block give out 0 and lse -inf, so that they vanish in the merge: the kernels return lse 0
    (CPU) or undefined values for them."""
    bias = additive_mask(mask, q, q.shape[1])
    aux = ()
    if kernel == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    elif kernel == "flash":
        if bias is not None:
            raise ValueError("cp_kernels: the flash kernel was given a masked block. Fix: block_kernel picks "
                             "'efficient' or 'cudnn' for masked blocks")
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        aux = (cum_q, cum_k, max_q, max_k, seed, offset)
    elif kernel == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                              scale=scale)
        lse = lse[..., :q.shape[2]]
        aux = (seed, offset)
    elif kernel == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, True, 0.0, causal, False, scale=scale)
        lse = lse.reshape(q.shape[:3])
        aux = (cum_q, cum_k, max_q, max_k, seed, offset)
    else:
        raise ValueError(f"cp_kernels: kernel {kernel!r} is not an SDPA kernel. Fix: one of {', '.join(KERNELS)}")
    lse = lse.float()
    if mask is not None:
        seen = mask.any(-1)  # (B or 1, 1, Lq)
        lse = torch.where(seen, lse, float("-inf"))
        out = torch.where(seen.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out, lse, aux


def block_backward(kernel: str, grad_out, q, k, v, out, lse, mask, causal: bool, scale: float, aux=()):
    """(dq, dk, dv) of one block, in the inputs' dtype, given the rows' final output and log-sum-exp."""
    bias = additive_mask(mask, q, q.shape[1])
    # a row that sees no key at all (lse -inf) has output 0 and no gradient: +inf makes its P = exp(S - lse) 0
    lse = torch.where(torch.isfinite(lse), lse, float("inf")).contiguous()
    if kernel == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal,
                                                                          attn_mask=bias, scale=scale)
    if kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse, cum_q, cum_k,
                                                                 q.shape[2], k.shape[2], 0.0, causal, seed, offset,
                                                                 scale=scale)
    if kernel == "efficient":
        seed, offset = aux
        width = _lse_width(kernel, q.shape[2])
        lse = torch.nn.functional.pad(lse, (0, width - q.shape[2])) if width > q.shape[2] else lse
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _bhld_as_blhd(grad_out), q, k, v, bias, _bhld_as_blhd(out), lse, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    if kernel == "cudnn":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, bias, cum_q, cum_k,
            q.shape[2], k.shape[2], 0.0, causal, scale=scale)
    raise ValueError(f"cp_kernels: kernel {kernel!r} is not an SDPA kernel. Fix: one of {', '.join(KERNELS)}")

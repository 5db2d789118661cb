"""Where each token lives under context parallel: the head-tail (zig-zag) layout and the batch split.

The sequence (padded on the right to a multiple of ``2 * cp``) is cut into ``2 * cp`` equal chunks; rank ``r``
holds chunks ``r`` and ``2cp - 1 - r``. Under causal attention a query chunk ``i`` attends to the key chunks
``0..i``, so every rank's pair costs ``(r + 1) + (2cp - r) = 2cp + 1`` chunk blocks: equal work on every rank,
whatever the masking inside the chunks (padding and document boundaries only remove work inside blocks).

Every tensor of the batch (token ids, targets, positions, padding mask) is split with the same index, and the
positions are always the *global* ones (``arange`` over the whole row when the batch has none, as transformers
does), so rotary and absolute position embeddings are exact on every shard.
"""
from __future__ import annotations

import torch

from ...distributed.sequence_padding import pad_sequence
from ...interface.config import ConfigError
from ...interface.fake_values import is_fake


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk numbers rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def local_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global token indices held by ``rank`` (``seq_len`` a multiple of ``2 * cp``), in local order."""
    c = seq_len // (2 * cp)
    lo, hi = chunk_ids(cp, rank)
    return torch.cat([torch.arange(lo * c, (lo + 1) * c, device=device),
                      torch.arange(hi * c, (hi + 1) * c, device=device)])


def layout_index(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Global indices of the tokens in rank order (rank 0's shard, then rank 1's, ...): what an all-gather of
    the shards along the sequence holds."""
    return torch.cat([local_index(seq_len, cp, r, device) for r in range(cp)])


def shard_batch(batch: dict, cp: int, rank: int) -> bool:
    """Split ``batch`` (input_ids, targets, optional attention_mask / position_ids, each (B, S)) in place into
    this rank's head-tail shard. Returns whether document masking applies: transformers infers packed
    documents from restarting ``position_ids`` only when no ``attention_mask`` is given, and so does this."""
    ids = batch["input_ids"]
    rows, seq = ids.shape
    mask = batch.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            raise ConfigError(f"cp={cp}: attention_mask of shape {tuple(mask.shape)}: context parallel builds the "
                              "mask itself from positions and needs the 2-D padding mask (rows x tokens). Fix: pass "
                              "a 2-D attention_mask, or none")
        # a dry run's rows hold no padding (interface.fake_values): on fake tensors, no value to read and none before
        if not is_fake(mask) and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ConfigError(f"cp={cp}: the attention_mask has padding before real tokens (left padding or holes). "
                              "Context parallel hides padding through causality and needs right padding. Fix: pad "
                              "on the right (tokenizer.padding_side = 'right')")
    positions = batch.get("position_ids")
    if positions is None:  # transformers' default, made over the whole row before it is split
        positions = torch.arange(seq, device=ids.device).expand(rows, seq)
    elif positions.dim() != 2:
        raise ConfigError(f"cp={cp}: position_ids of shape {tuple(positions.shape)}: context parallel needs one "
                          "position per token (rows x tokens; multi-axis rotary positions are not supported). Fix: "
                          "use a text-only model, or cp: 1")
    batch["position_ids"] = positions.expand(rows, seq)
    pad_sequence(batch, 2 * cp)  # on the right: after every real token, so causality hides it
    ids, mask, positions = batch["input_ids"], batch.get("attention_mask"), batch["position_ids"]
    total = ids.shape[1]
    index = local_index(total, cp, rank, ids.device)
    batch["input_ids"] = ids.index_select(1, index)
    batch["targets"] = batch["targets"].index_select(1, index)
    batch["position_ids"] = positions.index_select(1, index)
    if mask is not None:
        batch["attention_mask"] = mask.index_select(1, index)
    return mask is None


def segments(positions: torch.Tensor) -> torch.Tensor:
    """Document number of every token of (B, S) global-order positions: a new document starts wherever the
    position does not follow the previous one by 1 (transformers' rule for packed sequences)."""
    diff = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    return (diff != 1).cumsum(-1)


def visible(q_index: torch.Tensor, k_index: torch.Tensor, q_seg, k_seg, window: int | None) -> torch.Tensor:
    """Which keys each query sees, (B or 1, 1, Lq, Lk) bool: causal over global indices, within one document
    (when ``q_seg``/``k_seg`` are given, (B, Lq) / (B, Lk)), within the sliding window when there is one."""
    allowed = k_index[None, :] <= q_index[:, None]
    if window is not None:
        allowed = allowed & (q_index[:, None] - k_index[None, :] < window)
    allowed = allowed[None, None]
    if q_seg is not None:
        allowed = allowed & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    return allowed

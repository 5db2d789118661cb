"""Right padding of a batch's sequence to a multiple of a unit, for the dimensions that split the sequence into
equal parts (context parallel's head-tail chunks, sequence parallel's shards between tensor-parallel regions).

The padding goes after every real token of each row, so causal attention hides it from them; its targets are
ignored (-100), its attention mask is 0 and its positions continue the row's last one. The loss, the valid-token
count and every real token's output are those of the unpadded batch.
"""
from __future__ import annotations

import torch

from .loss import IGNORE_INDEX


def pad_sequence(batch: dict, unit: int) -> int:
    """Pad ``batch`` (``input_ids``, ``targets``, optional ``attention_mask`` and ``position_ids``, each rows x
    tokens) in place on the right to a multiple of ``unit`` tokens; returns the tokens added per row."""
    ids = batch["input_ids"]
    extra = -ids.shape[1] % unit
    if not extra:
        return 0

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, extra), value=value)

    batch["input_ids"] = pad(ids, 0)
    batch["targets"] = pad(batch["targets"], IGNORE_INDEX)
    if batch.get("attention_mask") is not None:
        batch["attention_mask"] = pad(batch["attention_mask"], 0)
    positions = batch.get("position_ids")
    if positions is not None:
        steps = torch.arange(1, extra + 1, device=positions.device)
        batch["position_ids"] = torch.cat([positions, positions[..., -1:] + steps], dim=-1)
    return extra

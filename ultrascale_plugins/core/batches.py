"""A batch on the device: the one move every path into the model makes first (the step's ``prepare_batch``, a
plain forward of ``hf_module``, the probe of ``token_places``)."""
from __future__ import annotations

import torch


def to_device(batch: dict, device: torch.device) -> dict:
    """``batch`` with its tensors on ``device`` (other values as they are)."""
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

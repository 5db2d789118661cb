"""The command line's data path as ``DataLoader``s, for a Lightning ``LightningDataModule`` or an Accelerate loop:
the same tokenization (cache, chat template, assistant-only labels) and the same packed rows as ``ultrascale
train``. The framework's own sampler then splits and shuffles the rows across data-parallel ranks, as it does for
any dataset; the rows themselves (which samples share a row) are those of the command line's first epoch.

    loaders = build_dataloaders({"dataset": "sft.jsonl", "format": "chat", "seq_len": 2048}, "path/to/model",
                                batch_size=4)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from ..interface.config import ConfigError


class RowDataset(Dataset):
    """The rows of one ``packed_rows.Rows`` as map-style samples: ``input_ids``, ``labels``, ``position_ids``."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return self.rows.rows_per_epoch

    def __getitem__(self, index):
        return self.rows.row(int(index))


def data_spec(data) -> "DataSpec":
    """A recipe's ``data`` section (a dict, as in a recipe file) or a ``DataSpec``, checked as a recipe's is."""
    from .recipe import DataSpec, _typed

    if isinstance(data, DataSpec):
        return data
    spec = _typed("data", DataSpec, data)
    if not spec.dataset:
        raise ConfigError("data.dataset is empty: the data loaders read a dataset. Fix: set data.dataset")
    return spec


def build_datasets(data, tokenizer: str, *, seed: int = 0):
    """``(train, validation or None)`` row datasets of ``data`` with the tokenizer in directory ``tokenizer``
    (tokenized into the cache on first use)."""
    from .packed_rows import Rows, split_indices
    from .tokenized_cache import prepare

    spec = dataclasses.replace(data_spec(data), tokenizer=tokenizer)
    if (Path(tokenizer) / "config.json").is_file():  # the model's own directory: packing must suit its type
        from transformers import AutoConfig

        from .recipe_data import check_packing

        check_packing(spec, AutoConfig.from_pretrained(tokenizer))
    tokenized = prepare(spec, None)
    train_idx, eval_idx = split_indices(len(tokenized.lengths), spec.eval_fraction, seed)
    # shuffle=False: the framework's sampler orders the rows (and reshuffles them each epoch)
    train = RowDataset(Rows(tokenized, train_idx, spec.seq_len, spec.packing, seed, shuffle=False))
    val = RowDataset(Rows(tokenized, eval_idx, spec.seq_len, spec.packing, seed, shuffle=False)) \
        if len(eval_idx) else None
    if not len(train):
        raise ConfigError(f"data.dataset={spec.dataset!r} makes no row of {spec.seq_len} tokens. Fix: a shorter "
                          "seq_len or more data")
    return train, val


def build_dataloaders(data, tokenizer: str, *, batch_size: int, seed: int = 0, num_workers: int = 0):
    """``(train_loader, val_loader or None)``: ``batch_size`` rows per data-parallel rank and step."""
    train, val = build_datasets(data, tokenizer, seed=seed)
    g = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True, generator=g,
                              num_workers=num_workers)
    val_loader = DataLoader(val, batch_size=batch_size, drop_last=True, num_workers=num_workers) if val else None
    return train_loader, val_loader

"""``UltraScaleDataModule``: a recipe's ``data`` section as a ``LightningDataModule`` — the command line's
tokenization, chat labels and packed rows (``ultrascale_plugins.data.data_loaders``), tokenized once per node in
``prepare_data`` (Lightning calls it on each node's local rank 0) and memory-mapped by every rank in ``setup``.

    dm = UltraScaleDataModule({"dataset": "sft.jsonl", "format": "chat", "seq_len": 2048}, "path/to/model",
                              batch_size=4)
    trainer.fit(module, datamodule=dm)
"""
from __future__ import annotations

import lightning.pytorch as L
from torch.utils.data import DataLoader

from ultrascale_plugins.data.data_loaders import build_datasets, data_spec


class UltraScaleDataModule(L.LightningDataModule):
    def __init__(self, data, tokenizer: str, *, batch_size: int, seed: int = 0, num_workers: int = 0):
        super().__init__()
        self.spec, self.tokenizer = data_spec(data), str(tokenizer)
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.train_set = self.val_set = None

    def prepare_data(self):  # one process per node: the tokenized cache is written here
        build_datasets(self.spec, self.tokenizer, seed=self.seed)

    def setup(self, stage: str | None = None):
        self.train_set, self.val_set = build_datasets(self.spec, self.tokenizer, seed=self.seed)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self):
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True, num_workers=self.num_workers)

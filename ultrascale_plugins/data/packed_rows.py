"""Training rows of a tokenized dataset, in epochs, addressed by their global row number.

An epoch is the training samples in an order shuffled from the seed and the epoch number. With packing they are
laid end to end and cut into ``seq_len`` rows (a sample longer than a row continues in the next one); without,
each sample is one row, padded on the right. ``position_ids`` restart at each sample, which is how transformers
tells packed samples apart when no attention mask is given (sdpa, eager, flex and flash attention then keep each
sample's attention to itself); the first token of a sample is never a target (``-100``), so no sample learns
from its neighbour. Right padding needs no mask either: a causal row never attends forward, and padding is
``-100``. The whole global batch's rows are known from the row number alone: a resumed run continues with
exactly the next rows, mid-epoch too, and each data-parallel rank reads only its own rows from the
memory-mapped Arrow files."""
from __future__ import annotations

import numpy as np
import torch

from ..interface.config import ConfigError
from ..distributed.loss import IGNORE_INDEX


class Rows:
    def __init__(self, tokenized, indices: np.ndarray, seq_len: int, packing: bool, seed: int, shuffle: bool):
        self.data, self.seq_len, self.packing, self.seed, self.shuffle = tokenized, seq_len, packing, seed, shuffle
        self.indices = np.asarray(indices, dtype=np.int64)
        lengths = tokenized.lengths[self.indices]
        if not packing and len(lengths) and lengths.max() > seq_len:
            worst = int(np.argmax(lengths))
            raise ConfigError(f"data.packing=false: {tokenized.where(int(self.indices[worst]))} has "
                              f"{int(lengths[worst])} tokens, more than data.seq_len={seq_len}. Fix: raise seq_len "
                              "to at least that, turn packing on (long samples continue in the next row), or drop "
                              "the sample")
        self.rows_per_epoch = int(lengths.sum() // seq_len) if packing else len(lengths)
        self._plan: tuple[int, np.ndarray, np.ndarray] | None = None

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's sample order and (packing) the cumulative token count at the end of each sample."""
        if self._plan is None or self._plan[0] != epoch:
            order = self.indices
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = order[torch.randperm(len(order), generator=g).numpy()]
            ends = np.cumsum(self.data.lengths[order]) if self.packing else None
            self._plan = (epoch, order, ends)
        return self._plan[1], self._plan[2]

    def _sample(self, index: int) -> tuple[list[int], list[int]]:
        item = self.data.dataset[int(index)]
        return item["input_ids"], (item["labels"] if self.data.has_labels else
                                   [IGNORE_INDEX] + list(item["input_ids"][1:]))

    def row(self, number: int) -> dict[str, torch.Tensor]:
        """Global row ``number`` (epochs follow one another): ``input_ids``, ``labels``, ``position_ids``."""
        epoch, r = divmod(number, self.rows_per_epoch)
        order, ends = self._epoch(epoch)
        L = self.seq_len
        ids = np.full(L, self.data.pad_id, dtype=np.int64)
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        pos = np.arange(L, dtype=np.int64)
        if not self.packing:
            tokens, targets = self._sample(order[r])
            n = len(tokens)
            ids[:n], labels[:n] = tokens, targets
        else:
            start = r * L
            i = int(np.searchsorted(ends, start, side="right"))  # the sample holding token ``start``
            filled = 0
            while filled < L:
                sample_start = int(ends[i - 1]) if i else 0
                offset = start + filled - sample_start  # where in the sample this row picks up
                tokens, targets = self._sample(order[i])
                take = min(len(tokens) - offset, L - filled)
                ids[filled:filled + take] = tokens[offset:offset + take]
                labels[filled:filled + take] = targets[offset:offset + take]
                # positions restart with each piece: a sample continued from the row before starts at 0 too
                # (its earlier context is not in this row), as flash attention's packed path expects
                pos[filled:filled + take] = np.arange(take)
                filled += take
                i += 1
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos)}

    def rows(self, first: int, count: int) -> dict[str, torch.Tensor]:
        out = [self.row(first + k) for k in range(count)]
        return {key: torch.stack([o[key] for o in out]) for key in out[0]}


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Training and held-out sample indices: a fixed random ``eval_fraction`` of the samples is held out."""
    n_eval = int(round(n * eval_fraction))
    if eval_fraction and not n_eval:
        n_eval = 1
    g = torch.Generator().manual_seed(seed * 1_000_003 + 424242)
    perm = torch.randperm(n, generator=g).numpy()
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


class DatasetBatches:
    """A recipe's dataset as global batches: ``global_batch_at`` / ``local`` as for the byte-level corpus, plus
    the row arithmetic of epochs and resumption."""

    def __init__(self, tokenized, spec, global_batch: int, seed: int):
        train_idx, eval_idx = split_indices(len(tokenized.lengths), spec.eval_fraction, seed)
        self.train = Rows(tokenized, train_idx, spec.seq_len, spec.packing, seed, True)
        self.val = Rows(tokenized, eval_idx, spec.seq_len, spec.packing, seed, False) \
            if len(eval_idx) else None
        self.global_batch, self.key = global_batch, tokenized.key
        if self.train.rows_per_epoch < global_batch:
            raise ConfigError(f"data.dataset={spec.dataset!r} makes {self.train.rows_per_epoch} training rows of "
                              f"{spec.seq_len} tokens, fewer than train.global_batch={global_batch}. Fix: a smaller "
                              "global_batch or seq_len, or more data")
        self.eval_batches = self.val.rows_per_epoch // global_batch if self.val else 0
        if self.val is not None and not self.eval_batches:
            raise ConfigError(f"data.eval_fraction={spec.eval_fraction}: the held-out samples make "
                              f"{self.val.rows_per_epoch} rows, fewer than one global batch ({global_batch}). Fix: "
                              "a larger eval_fraction, or 0 for no validation")

    @property
    def steps_per_epoch(self) -> int:
        return self.train.rows_per_epoch // self.global_batch

    def global_batch_at(self, step: int, split: str = "train", first_row: int = 0) -> dict:
        rows = self.train if split == "train" else self.val
        return rows.rows(first_row + step * self.global_batch, self.global_batch)

    def local_rows(self, step: int, dp_rank: int, dp_size: int, first_row: int = 0, split: str = "train") -> dict:
        """Only this data-parallel rank's rows of the global batch (nothing else is read)."""
        per = self.global_batch // dp_size
        rows = self.train if split == "train" else self.val
        return rows.rows(first_row + step * self.global_batch + dp_rank * per, per)

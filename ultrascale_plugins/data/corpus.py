"""The bundled text corpus as byte-level tokens (vocabulary 256), and deterministic global batches."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from ..interface.config import ConfigError


def _corpus_file(corpus: str):
    if corpus == "builtin":
        return resources.files("ultrascale_plugins").joinpath("resources/corpus.txt")
    p = Path(corpus)
    if not p.is_file():
        raise ConfigError(f"data.corpus={corpus!r}: no such file. Fix: use builtin or a path to a text file")
    return p


def load_tokens(corpus: str = "builtin") -> torch.Tensor:
    return torch.frombuffer(bytearray(_corpus_file(corpus).read_bytes()), dtype=torch.uint8).long()


def check_corpus(corpus: str, seq_len: int, length: int | None = None) -> None:
    """The byte corpus must hold training and held-out windows of ``seq_len`` (checked before launch from the
    file's size, and again by the workers)."""
    if length is None:
        with _corpus_file(corpus).open("rb") as f:
            length = f.seek(0, 2)
    if length < 2 * (seq_len + 1):
        name = "the built-in corpus" if corpus == "builtin" else f"data.corpus {corpus}"
        raise ConfigError(f"data.seq_len={seq_len}: {name} has only {length:,} tokens (bytes), fewer than two "
                          f"windows of {seq_len + 1}. Fix: set data.dataset to your data (and data.tokenizer), or "
                          f"use data.seq_len of at most {max(1, length // 2 - 1)}")


class ByteBatches:
    """Random windows of ``seq_len`` bytes; batch ``i`` is the same on every rank and every layout for a given
    seed, and each data-parallel rank takes its contiguous slice of the rows."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int, holdout: float = 0.1,
                 corpus: str = "builtin"):
        check_corpus(corpus, seq_len, len(tokens))
        split = int(len(tokens) * (1 - holdout))
        self.train, self.val = tokens[:split], tokens[split - seq_len:]
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed

    def _windows(self, source: torch.Tensor, index: int, seed_offset: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + seed_offset * 7919 + index)
        starts = torch.randint(0, len(source) - self.seq_len, (self.global_batch,), generator=g)
        return torch.stack([source[s:s + self.seq_len] for s in starts.tolist()])

    def global_batch_at(self, step: int, split: str = "train") -> dict:
        source = self.train if split == "train" else self.val
        return {"input_ids": self._windows(source, step, 0 if split == "train" else 1)}

    def local(self, batch: dict, dp_rank: int, dp_size: int) -> dict:
        if self.global_batch % dp_size:
            raise ConfigError(f"train.global_batch={self.global_batch} is not divisible by the data-parallel degree "
                              f"{dp_size}. Fix: use a multiple of {dp_size}")
        per = self.global_batch // dp_size
        return {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in batch.items()}


class TokenWindows(torch.utils.data.Dataset):
    """Consecutive ``seq_len``-token windows as causal-LM samples (``input_ids`` = ``labels``), for the
    Lightning and Accelerate recipes."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        ids = self.tokens[i * self.seq_len:(i + 1) * self.seq_len]
        return {"input_ids": ids, "labels": ids}


def tiny_llama(seed: int = 0):
    """The recipes' default model: a 4-layer Llama over the byte vocabulary, built from a config."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256))

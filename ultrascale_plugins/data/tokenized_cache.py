"""Tokenize a recipe's dataset once, into a cache every rank of a node memory-maps.

The key of a cache entry is a hash of what decides the tokens: the data files (path, size, modification time),
the tokenizer (by what it produces, not its files), the format and the field names. ``ultrascale train`` tokenizes before it starts the
workers (once per node: the command runs once on each); a worker started some other way (torchrun, SLURM) finds
the entry, or its node's local rank 0 writes it while the others wait. An entry appears complete or not at all
(written beside, then renamed). Tokenization runs in ``datasets.map`` (parallel over ``num_proc`` processes)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..interface.config import ConfigError

FORMAT_VERSION = 2  # bump when the tokenization below changes what it writes


def cache_root(spec) -> Path:
    root = spec.cache_dir or os.environ.get("ULTRASCALE_CACHE") or Path.home() / ".cache" / "ultrascale"
    return Path(root).expanduser()


def tokenizer_dir(spec, init_from: str | None) -> str:
    source = spec.tokenizer or init_from
    if not source:
        raise ConfigError("data.dataset needs a tokenizer: data.tokenizer is not set and there is no --init-from "
                          "directory to take it from. Fix: set data.tokenizer: path/to/tokenizer_dir, or pass "
                          "--init-from HF_DIR")
    if not Path(source).is_dir():
        raise ConfigError(f"data.tokenizer={source!r}: no such directory. Fix: point it at a directory written by "
                          "tokenizer.save_pretrained")
    return str(source)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ConfigError(f"data.tokenizer: no tokenizer could be loaded from {path} ({str(exc).splitlines()[0]}). "
                          "Fix: point data.tokenizer (or --init-from) at a directory with tokenizer.json / "
                          "tokenizer_config.json") from None


# Text a tokenizer's identity includes the ids of: its normalizer, pre-tokenizer and post-processor (added BOS/EOS)
# show there, beyond what its vocabulary and merges say
_PROBE = "Hello, World!  123\tÜnïcödé — 日本語 text\n  with  spaces."


def tokenizer_identity(tokenizer) -> str:
    """A tokenizer by what it produces: vocabulary, merges, special tokens, chat template and the ids of a probe
    text. Not its files' bytes or its class: transformers saves the same tokenizer again under another class with
    other bytes (a checkpoint's copy), and that copy must still be the same tokenizer."""
    merges = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        merges = json.loads(backend.to_str()).get("model", {}).get("merges")
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    added = sorted((int(i), str(t)) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items())
    ident = {"vocab": sorted(tokenizer.get_vocab().items()), "merges": merges, "special": special, "added": added,
             "chat_template": getattr(tokenizer, "chat_template", None),
             "probe": tokenizer(_PROBE)["input_ids"]}
    return hashlib.sha256(json.dumps(ident, default=str, sort_keys=True).encode()).hexdigest()


def cache_key(spec, tokenizer) -> str:
    """The cache entry of a dataset: its files (path, size, modification time), the format and fields, and the
    tokenizer's identity (``tokenizer_identity``)."""
    from .dataset_files import dataset_files

    h = hashlib.sha256(json.dumps([FORMAT_VERSION, spec.format, spec.text_field, spec.messages_field]).encode())
    files = dataset_files(spec.dataset)
    listing = sorted(Path(spec.dataset).rglob("*")) if files is None else files
    for f in [p for p in listing if p.is_file()]:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(tokenizer_identity(tokenizer).encode())
    return h.hexdigest()[:20]


@dataclass
class Tokenized:
    """A tokenized dataset: ``input_ids`` (and ``labels`` for chat) per sample, memory-mapped, and its lengths."""
    dataset: object  # datasets.Dataset
    lengths: "object"  # numpy int64 array, one per sample
    key: str
    path: Path
    has_labels: bool
    tokenizer: object  # the tokenizer it was made with (saved into checkpoints)
    sources: dict  # {"files": [...], "ends": [...]}: which file a sample came from

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0))

    def where(self, index: int) -> str:
        from .dataset_files import SourceFiles

        return SourceFiles(None, self.sources["files"], self.sources["ends"]).where(index)


def _tokenize_batch(tokenizer, spec, source):
    """The ``datasets.map`` function (batched, with indices)."""
    from .chat_tokens import chat_sample
    from ..distributed.loss import IGNORE_INDEX

    eos = tokenizer.eos_token_id

    def run(batch, indices):
        out = {"input_ids": [], "length": []}
        if spec.format == "chat":
            out["labels"] = []
        column = spec.messages_field if spec.format == "chat" else spec.text_field
        for value, i in zip(batch[column], indices):
            where = source.where(i)
            if value is None:
                raise ConfigError(f"data.{'messages' if spec.format == 'chat' else 'text'}_field={column!r}: "
                                  f"{where} has no value there. Fix: fill or remove the row")
            if spec.format == "chat":
                ids, labels = chat_sample(tokenizer, value, where)
                labels[0] = IGNORE_INDEX
                out["labels"].append(labels)
            else:
                if not isinstance(value, str):
                    raise ConfigError(f"data.text_field={column!r}: {where} holds {type(value).__name__}, not text. "
                                      "Fix: point text_field at a string column")
                ids = tokenizer(value)["input_ids"]
                if eos is not None and (not ids or ids[-1] != eos):
                    ids = ids + [eos]  # documents end with end-of-text, so the model learns where they stop
            out["input_ids"].append(ids)
            out["length"].append(len(ids))
        return out

    return run


def _build(spec, tok_path: str, final: Path) -> None:
    from .dataset_files import load_source

    tokenizer = load_tokenizer(tok_path)
    if spec.format == "chat":
        from .chat_tokens import check_chat_tokenizer

        check_chat_tokenizer(tokenizer, tok_path)
    source = load_source(spec.dataset, cache_root(spec) / "raw")
    ds = source.dataset
    column = spec.messages_field if spec.format == "chat" else spec.text_field
    if column not in ds.column_names:
        field = "messages_field" if spec.format == "chat" else "text_field"
        raise ConfigError(f"data.{field}={column!r}: {', '.join(source.files[:3])} has no such column (columns: "
                          f"{', '.join(ds.column_names)}). Fix: set data.{field} to one of them")
    if len(ds) == 0:
        raise ConfigError(f"data.dataset={spec.dataset!r} is empty (no rows in {', '.join(source.files[:3])}). "
                          "Fix: point it at a dataset with samples")
    procs = spec.num_proc or (1 if len(ds) < 20_000 else min(8, os.cpu_count() or 1))
    print(f"ultrascale: tokenizing {spec.dataset} ({len(ds):,} samples, {procs} process{'es' if procs > 1 else ''}; "
          f"once for this node) into {final}", flush=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    try:
        tmp.mkdir()
        # map writes its Arrow files (one per process) straight into the entry: no second copy of the tokens
        ds.map(_tokenize_batch(tokenizer, spec, source), batched=True, with_indices=True,
               remove_columns=ds.column_names, num_proc=procs if procs > 1 else None,
               cache_file_name=str(tmp / "tokens.arrow"), desc="ultrascale: tokenizing")
        (tmp / "sources.json").write_text(json.dumps({"files": source.files, "ends": source.ends}))
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def prepare(spec, init_from: str | None = None, *, build: bool = True) -> Tokenized:
    """The tokenized dataset of ``spec``, from the cache (written first when missing and ``build``)."""
    import datasets
    import numpy as np

    datasets.disable_progress_bars()
    tok_path = tokenizer_dir(spec, init_from)
    tokenizer = load_tokenizer(tok_path)
    key = cache_key(spec, tokenizer)
    final = cache_root(spec) / "tokenized" / key
    if not final.exists():
        if not build:
            raise FileNotFoundError(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        _build(spec, tok_path, final)
    shards = sorted(final.glob("tokens*.arrow"))  # tokens.arrow, or tokens_00000_of_0000N.arrow, ... in order
    ds = datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in shards])
    lengths = np.asarray(ds.data.column("length").to_numpy(), dtype=np.int64)
    sources = json.loads((final / "sources.json").read_text())
    return Tokenized(ds, lengths, key, final, "labels" in ds.column_names, tokenizer, sources)


def prepare_on_node(spec, init_from: str | None):
    """In a worker: the cache entry, written by this node's local rank 0 when no launcher wrote it first."""
    import torch.distributed as dist

    # every rank reaches the barrier, found or not: a rank that skipped it because local rank 0 had just
    # finished writing would meet the others' barrier with its next collective
    built = prepare(spec, init_from) if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None  # writes if missing
    if dist.is_initialized():
        dist.barrier()  # every node's local rank 0 has its node's entry
    return built if built is not None else prepare(spec, init_from, build=False)

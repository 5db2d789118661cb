"""A recipe's ``data.dataset`` read with Hugging Face ``datasets``: a ``.jsonl`` / ``.json`` / ``.parquet`` /
``.txt`` file, a directory of such files, or a directory written by ``Dataset.save_to_disk``. The rows stay in
memory-mapped Arrow files (nothing is loaded into RAM); each row can be traced back to its file and line."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..interface.config import ConfigError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


@dataclass
class SourceFiles:
    """The loaded rows and, for messages, which file each row came from."""
    dataset: object  # datasets.Dataset
    files: list[str]
    ends: list[int]  # cumulative row counts, one per file

    def where(self, row: int) -> str:
        """``file, row N`` of a row of the concatenated dataset (rows counted from 1, as editors do)."""
        start = 0
        for name, end in zip(self.files, self.ends):
            if row < end:
                return f"{name}, row {row - start + 1}"
            start = end
        return f"row {row + 1}"


def dataset_files(path: str) -> list[Path] | None:
    """The data files of ``path`` (sorted), or None for a ``save_to_disk`` directory."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.dataset={path!r}: no such file or directory. Fix: point it at a .jsonl, .json, "
                          ".parquet or .txt file, a directory of them, or a datasets.save_to_disk directory")
    if p.is_dir():
        if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
            return None
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS)
        if not files:
            raise ConfigError(f"data.dataset={path!r}: the directory holds no .jsonl, .json, .parquet or .txt file "
                              "and is not a datasets.save_to_disk directory. Fix: point it at the data files")
    else:
        if p.suffix not in BUILDERS:
            raise ConfigError(f"data.dataset={path!r}: unknown file type '{p.suffix}'. Fix: use a .jsonl, .json, "
                              ".parquet or .txt file")
        files = [p]
    kinds = {BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise ConfigError(f"data.dataset={path!r} mixes file types ({', '.join(sorted(kinds))}). Fix: keep one "
                          "type of file in the directory")
    return files


def load_source(path: str, cache_dir: Path) -> SourceFiles:
    """Every row of ``path`` as one memory-mapped ``datasets.Dataset`` (Arrow files under ``cache_dir``)."""
    import datasets

    datasets.disable_progress_bars()
    files = dataset_files(path)
    if files is None:
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(f"data.dataset={path!r}: a DatasetDict without a 'train' split (splits: "
                                  f"{', '.join(loaded)}). Fix: save the training split, or name it 'train'")
            loaded = loaded["train"]
        return SourceFiles(loaded, [path], [len(loaded)])
    files = [f for f in files if f.stat().st_size > 0]  # an empty file holds no rows (and no schema)
    if not files:
        raise ConfigError(f"data.dataset={path!r} is empty (no rows). Fix: point it at a dataset with samples")
    parts, ends = [], []
    for f in files:
        builder = BUILDERS[f.suffix]
        # .txt: one sample per paragraph (blank-line separated), the way a plain-text corpus is usually split
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            part = datasets.load_dataset(builder, data_files=str(f), split="train", cache_dir=str(cache_dir), **extra)
        except Exception as exc:  # a malformed line: datasets' parser names the problem, we name the file
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"data.dataset: {f} could not be read ({first}). Fix: check the file's format "
                              f"({builder})") from None
        parts.append(part)
        ends.append((ends[-1] if ends else 0) + len(part))
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return SourceFiles(dataset, [str(f) for f in files], ends)

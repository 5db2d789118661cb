"""The model config of a pretrained Hugging Face directory (``save_pretrained``: ``config.json``), the first thing
read when a model is built from one (``load.from_pretrained``, the command line's ``--init-from``)."""
from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError


def read_config(path: str | Path, trust_remote_code: bool = False):
    """The model config of an HF directory (never runs repository code unless asked to); a config.json that is not
    JSON or holds a value transformers refuses is one line naming the file, not transformers' traceback."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"'{path}' is not a Hugging Face model directory (no config.json). Fix: pass the "
                              "directory written by save_pretrained")
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    # transformers says a file that is not JSON with an OSError, a refused value with its strict checks' error
    except (OSError, ValueError, TypeError, StrictDataclassError) as exc:
        said = " ".join(str(exc.__cause__ or exc).split()).rstrip(".")
        raise CheckpointError(f"'{path / 'config.json'}' does not make a model config: {said}. Fix: correct the "
                              "file, or write it again with save_pretrained") from None

"""What the plugins save beside the model (``ultrascale_state_save``) and read back (``ultrascale_state_load``):
filled by ``ParallelModel.state_dict`` and by the sharded checkpoints (``checkpoints.sharded``), which build on the
engine and so take it from here."""
from __future__ import annotations

from typing import Any


class PluginState:
    """What the plugins save through ``ultrascale_state_save``: ``shared`` holds what every rank holds alike
    (tensors go into the sharded files, other values, which must be JSON, into ``ultrascale.json``);
    ``rank_local`` what differs per rank (tensors and containers of them, one file per rank, restored only when
    the world size is unchanged). ``left_out``: model entries (the unparallelized model's names) a plugin keeps
    out of the checkpoint, on save and on load, because the model the caller builds supplies them (a PEFT model's
    frozen base). ``loading``: on a load, the metadata (``ultrascale.json``) of the checkpoint about to be read,
    so that a plugin can leave out what it lacks and refuse it before anything is read; None on a save."""

    def __init__(self, shared: dict | None = None, rank_local: dict | None = None, loading: dict | None = None):
        self.shared: dict[str, Any] = dict(shared or {})
        self.rank_local: dict[str, Any] = dict(rank_local or {})
        self.left_out: set[str] = set()
        self.loading = loading

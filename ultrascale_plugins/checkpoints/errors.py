"""``CheckpointError``: what every checkpoint reader refuses with (DCP checkpoints, their checksums, pretrained
directories, exports). Its own module, below them all, so that none of them imports another for it."""
from __future__ import annotations

from ..interface.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded: missing, incomplete, truncated, or from an incompatible run."""

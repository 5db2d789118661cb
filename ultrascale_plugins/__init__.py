"""ultrascale-plugins: ZeRO, tensor, sequence (and, as plugins land, pipeline and context) parallelism for
Hugging Face causal LMs, composed on one device mesh, behind pluggy hooks."""
from __future__ import annotations

__version__ = "0.1.0"

from .config import ConfigError, ParallelConfig
from .hookspecs import hookimpl, hookspec
from .launch import init_distributed
from .plugins import get_plugin_manager, list_plugins, register

__all__ = ["ConfigError", "ParallelConfig", "ParallelModel", "hookimpl", "hookspec", "init_distributed",
           "parallelize", "get_plugin_manager", "list_plugins", "register", "validate", "estimate",
           "__version__"]


def __getattr__(name):  # the engine pulls in torch.distributed; import it on first use
    if name in ("parallelize", "ParallelModel", "validate", "estimate"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)

"""ultrascale-plugins: ZeRO, tensor, sequence and pipeline parallelism for Hugging Face causal LMs, composed on
one device mesh, behind pluggy hooks. The front ends (Lightning, Accelerate, ``transformers.Trainer``) live in
``ultrascale_plugins.integrations``; the rest of the package imports neither Lightning nor Accelerate."""
from __future__ import annotations

__version__ = "0.1.0"

from .config import ConfigError, ParallelConfig
from .hookspecs import hookimpl, hookspec
from .launch import init_distributed
from .parallel_dims import MeshAxis
from .plugins import get_plugin_manager, list_plugins, register

__all__ = ["ConfigError", "MeshAxis", "ParallelConfig", "ParallelModel", "hookimpl", "hookspec",
           "init_distributed", "parallelize", "from_pretrained", "get_plugin_manager", "list_plugins", "register",
           "validate", "estimate", "__version__"]


def __getattr__(name):  # the engine pulls in torch.distributed; import it on first use
    if name in ("parallelize", "from_pretrained", "ParallelModel", "validate", "estimate"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)

"""ultrascale-plugins: ZeRO, tensor, sequence (and, as plugins land, pipeline and context) parallelism for
Hugging Face causal LMs, composed on one device mesh, behind pluggy hooks."""
from __future__ import annotations

__version__ = "0.1.0"

from .config import ConfigError, ParallelConfig
from .hookspecs import hookimpl, hookspec
from .launch import init_distributed
from .parallel_dims import MeshAxis
from .plugins import get_plugin_manager, list_plugins, register

__all__ = ["ConfigError", "MeshAxis", "ParallelConfig", "ParallelModel", "hookimpl", "hookspec", "init_distributed",
           "parallelize", "get_plugin_manager", "list_plugins", "register", "validate", "estimate",
           "__version__"]


def _checkout_integrations() -> None:
    """In a source checkout the framework adapters live in ``../integrations`` and are installed as
    ``ultrascale_plugins.integrations`` (pyproject.toml's package-dir). When the package is imported from the
    checkout itself — ``python -m ultrascale_plugins.cli`` from the repository root puts it ahead of the installed
    copy — register that directory under the same name, so both ways of running see the same package."""
    import importlib.util
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    source = here.parent / "integrations"
    name = f"{__name__}.integrations"
    if (name in sys.modules or (here / "integrations").exists() or not (here.parent / "pyproject.toml").is_file()
            or not (source / "__init__.py").is_file()):
        return
    spec = importlib.util.spec_from_file_location(name, source / "__init__.py",
                                                  submodule_search_locations=[str(source)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_checkout_integrations()


def __getattr__(name):  # the engine pulls in torch.distributed; import it on first use
    if name in ("parallelize", "ParallelModel", "validate", "estimate"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)

"""ultrascale-plugins: ZeRO, tensor, sequence and pipeline parallelism for Hugging Face causal LMs, composed on
one device mesh, behind pluggy hooks. The front ends (Lightning, Accelerate, ``transformers.Trainer``) live in
``ultrascale_plugins.integrations``; the rest of the package imports neither Lightning nor Accelerate."""
from __future__ import annotations

__version__ = "0.1.0"

import sys as _sys

from .interface.config import ConfigError, ParallelConfig
from .interface.facts import LayoutFacts, layout_facts
from .interface.hookspecs import hookimpl, hookspec
from .interface.mesh_axes import MeshAxis, MeshView
from .core.registry import Registry, default_registry, make_registry
from .interface.stages import Stage, step


def _timing_mark(phase: str) -> None:
    """Append ``{"phase", "t", "cpu", "pid", "rank"}`` (wall clock, this process's CPU seconds) as a JSON line to
    the file ``ULTRASCALE_TIMINGS`` names (the start-up benchmark, ``benchmarks/startup.py``); nothing without it."""
    import os

    path = os.environ.get("ULTRASCALE_TIMINGS")
    if path:
        import json
        import time

        line = json.dumps({"phase": phase, "t": time.time(), "cpu": time.process_time(), "pid": os.getpid(),
                           "rank": os.environ.get("RANK")})
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


_freezing_at_exit = False


def quiet_known_warnings() -> None:
    """Silence warnings that fire on every run and say nothing actionable to a user: FSDP2's note that the
    root returns a view (our step does no in-place op on the logits), DTensor's note that a norm over a 2-D
    mesh takes two all-reduces, and, where torchao is installed, the notes of its import
    (``_quiet_torchao_import``, also done when the package is imported)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    _quiet_torchao_import()


class _DropNotes:
    """A ``logging.Filter`` that drops the records of one logger whose message matches ``drop(record)``."""

    def __init__(self, drop):
        self.drop = drop

    def filter(self, record) -> bool:
        try:
            return not self.drop(record)
        except Exception:  # noqa: BLE001 - a filter must never break a log call
            return True


def _cpu_only_library_failed(record) -> bool:
    """torchao's import note that one of its compiled libraries did not load, on a machine without a usable GPU:
    the libraries it ships are CUDA kernels (MX / float8 GEMMs, CUTLASS) that such a machine cannot run anyway."""
    torch = _sys.modules.get("torch")
    return (str(record.msg).startswith("Failed to load") and torch is not None
            and not torch.cuda.is_available())


def _enum_registration_note(record) -> bool:
    """torch's deprecation note, addressed to library authors, that a library (torchao) registers its enums with
    ``register_constant``: nothing a user can act on."""
    return "is an Enum subclass and is now natively supported" in str(record.msg)


def _quiet_torchao_import() -> None:
    """transformers imports torchao with every model when it is installed (its quantizer registry), and torchao's
    import then logs, in every process, that CUDA-only libraries did not load (on CPU) and torch notes how torchao
    registers its enums. Those two notes alone are dropped, by filters on their own loggers, from the moment the
    package is imported (a user's Lightning, Accelerate or Trainer script imports it before building its model);
    every other record of those loggers passes. Idempotent."""
    import logging

    for name, drop in (("torchao", _cpu_only_library_failed), ("torch.utils._pytree", _enum_registration_note)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotes) for f in logger.filters):
            logger.addFilter(_DropNotes(drop))


def _freeze_at_exit() -> None:
    """Register ``gc.freeze`` to run at interpreter exit (once per process; the command line and the worker
    call it first, so the handlers registered after them, e.g. ``launch``'s process-group teardown, run before).
    Python's exit runs full garbage collections over every object left, and with torch and transformers loaded
    those passes take about half a second of each process's exit on a small machine; frozen objects are skipped.
    Reference counting still frees what it frees, atexit handlers and output flushing run as before; only
    objects left in reference cycles are not collected (the OS takes the memory back), and nothing here leaves
    work to their finalizers (files are written in ``with`` blocks, writers and bars closed)."""
    global _freezing_at_exit
    if not _freezing_at_exit:
        import atexit
        import gc

        _freezing_at_exit = True
        atexit.register(gc.freeze)


_quiet_torchao_import()
_timing_mark("package_import")  # the start of every process that imports the package (workers: their first mark)

__all__ = ["ConfigError", "LayoutFacts", "MeshAxis", "MeshView", "ParallelConfig", "ParallelModel", "Stage",
           "hookimpl", "hookspec", "layout_facts", "step",
           "init_distributed", "parallelize", "from_pretrained", "get_plugin_manager", "list_plugins", "register",
           "unregister", "Registry", "make_registry",
           "validate", "estimate", "describe", "dry_run", "__version__"]


def get_plugin_manager() -> Registry:
    """The process-wide registry (a pluggy ``PluginManager``): the one ``parallelize``, the command line and the
    integrations use unless handed another (``make_registry()`` makes a fresh one)."""
    return default_registry()


def register(plugin, name: str | None = None) -> None:
    """Register a plugin object or module in the process-wide registry (tests, notebooks, scripts)."""
    default_registry().register(plugin, name=name)


def unregister(plugin=None, name: str | None = None):
    """Remove a plugin from the process-wide registry (by object or by name); returns it."""
    return default_registry().unregister(plugin=plugin, name=name)


def list_plugins() -> list[dict]:
    """One entry per registered plugin of the process-wide registry: name, source, version, hooks, fields."""
    return default_registry().plugins()


def __getattr__(name):  # the engine and the launch helpers pull in torch; import them on first use
    if name in ("parallelize", "from_pretrained"):  # a model and its weights, read once (checkpoints/load.py)
        from .checkpoints import load

        return getattr(load, name)
    if name in ("ParallelModel", "validate", "estimate", "describe"):
        from .core import engine

        return getattr(engine, name)
    if name == "init_distributed":
        from .distributed.launch import init_distributed

        return init_distributed
    if name == "dry_run":  # one step of the real code at full size on fake tensors (core/dry_run.py)
        from .core.dry_run import dry_run

        return dry_run
    raise AttributeError(name)

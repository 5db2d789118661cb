"""The standalone ``pytorch_lightning`` package: ``pytorch_lightning.Trainer(strategy="ultrascale_tp")``.

``pytorch_lightning`` is a copy of ``lightning.pytorch`` under another name, with its own base classes (its
Trainer checks ``isinstance`` against them) and its own ``StrategyRegistry``, so it gets its own pair of classes:
the logic of ``ultrascale_plugins.integrations.lightning`` over this package's ``ParallelStrategy`` and
``Precision``, with ``lightning_fabric``'s functions in place of ``lightning.fabric``'s.

``import ultrascale_plugins.integrations.lightning`` imports this module when ``pytorch_lightning`` is installed,
so one import registers the names in both packages.
"""
from __future__ import annotations

from lightning_fabric.utilities import distributed as fabric_distributed
from lightning_fabric.utilities import rank_zero as fabric_rank_zero
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector

from .lightning_common import _UltraScaleLauncherMixin, _UltraScalePrecisionMixin, _UltraScaleStrategyMixin


class UltraScalePrecision(_UltraScalePrecisionMixin, Precision):
    """Lightning's precision flags mapped onto the layout's mixed-precision policy (``pytorch_lightning``'s
    ``Precision``); see ``ultrascale_plugins.integrations.lightning.UltraScalePrecision``."""


class UltraScaleLauncher(_UltraScaleLauncherMixin, _SubprocessScriptLauncher):
    """Lightning's launcher, checking the layout against the model before it starts the other ranks."""


class UltraScaleStrategy(_UltraScaleStrategyMixin, ParallelStrategy):
    """A ``pytorch_lightning`` strategy for any layout of ultrascale-plugins; arguments as
    ``ultrascale_plugins.integrations.lightning.UltraScaleStrategy``."""

    _precision_class = UltraScalePrecision
    _launcher_class = UltraScaleLauncher
    _init_dist_connection = staticmethod(fabric_distributed._init_dist_connection)
    _sync_ddp_if_available = staticmethod(fabric_distributed._sync_ddp_if_available)
    _rank_zero_only = staticmethod(fabric_rank_zero.rank_zero_only)
    _lightning_optimizer_class = LightningOptimizer


UltraScaleStrategy.register_strategies(StrategyRegistry, _AcceleratorConnector)

__all__ = ["UltraScaleStrategy", "UltraScalePrecision", "UltraScaleLauncher"]

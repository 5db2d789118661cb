"""Lightning: ``Trainer(strategy="ultrascale_tp", devices=8)`` — every layout of ultrascale-plugins, pipeline
included, for an unchanged ``LightningModule`` that holds a Hugging Face causal LM.

    import ultrascale_plugins.integrations.lightning  # registers the strategy names
    trainer = Trainer(strategy="ultrascale_zero3", devices=4)
    trainer = Trainer(strategy=UltraScaleStrategy(pp=2, tp=2, dp_shard=2), devices=8)

The strategy is an adapter over the engine: in ``setup`` it finds the LightningModule's HF model (the child
module that is a ``PreTrainedModel`` with a causal-LM head), calls ``parallelize`` on it and puts a
``ParallelCausalLM`` in its place, so ``self.model(**batch).loss`` in ``training_step`` returns the global-mean
loss with exact gradients. Under a pipeline that call runs the schedule (forward and backward) and the strategy
skips Lightning's backward. Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fit(ckpt_path=)``)
are the package's sharded checkpoints: a directory at the path Lightning asks for.

Both ``lightning.pytorch`` and the standalone ``pytorch_lightning`` get the names, each its own classes (their
Trainers check their own base classes and keep their own registries): ``UltraScaleStrategy`` here, and
``ultrascale_plugins.integrations.pytorch_lightning.UltraScaleStrategy``, which this module imports (and so
registers) when ``pytorch_lightning`` is installed. The logic is written once, in ``lightning_common.py``'s mixins; the concrete
classes add the Lightning base class and the few functions that differ between the two packages.
"""
from __future__ import annotations

import importlib.util

from lightning.fabric.utilities import distributed as fabric_distributed
from lightning.fabric.utilities import rank_zero as fabric_rank_zero
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from .layout import make_config
from .lightning_common import (_UltraScaleLauncherMixin, _UltraScalePrecisionMixin, _UltraScaleStrategyMixin,
                               find_causal_lm)


class UltraScalePrecision(_UltraScalePrecisionMixin, Precision):
    """Lightning's precision flags mapped onto the layout's mixed-precision policy; autocast, if any, runs
    inside the engine (FSDP's policy or the model call), so this plugin's contexts are empty."""


class UltraScaleLauncher(_UltraScaleLauncherMixin, _SubprocessScriptLauncher):
    """Lightning's launcher, checking the layout against the model before it starts the other ranks."""


class UltraScaleStrategy(_UltraScaleStrategyMixin, ParallelStrategy):
    """A Lightning strategy for any layout of ultrascale-plugins.

    Args:
        config: a ``ParallelConfig``, a dict of its fields, or a YAML path (default: ZeRO-3 over all devices).
        preset: a named rule that picks the degrees from the devices and the model (see ``presets.py``).
        init_from: a ``save_pretrained`` directory to load into the layout, each rank reading its shards.
        timeout: seconds (or timedelta) bounding every collective.
        **fields: ``ParallelConfig`` fields (``tp=2, pp=2, ...``), applied over ``config``.
    """

    _precision_class = UltraScalePrecision
    _launcher_class = UltraScaleLauncher
    _init_dist_connection = staticmethod(fabric_distributed._init_dist_connection)
    _sync_ddp_if_available = staticmethod(fabric_distributed._sync_ddp_if_available)
    _rank_zero_only = staticmethod(fabric_rank_zero.rank_zero_only)
    _lightning_optimizer_class = LightningOptimizer


UltraScaleStrategy.register_strategies(StrategyRegistry, _AcceleratorConnector)

if importlib.util.find_spec("pytorch_lightning") is not None:
    # the standalone package: its own base classes and registry get their own pair of classes
    from . import pytorch_lightning as _pytorch_lightning  # noqa: E402,F401  (registers the names)

__all__ = ["UltraScaleStrategy", "UltraScalePrecision", "UltraScaleLauncher", "find_causal_lm", "make_config"]

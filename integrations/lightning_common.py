"""What the Lightning strategy does, independent of which Lightning package it plugs into: plain mixins that
``integrations/lightning.py`` (``lightning.pytorch``) and ``integrations/pytorch_lightning.py`` (the standalone
``pytorch_lightning``) put over their own package's ``ParallelStrategy`` and ``Precision``; the few functions that
differ between the packages are class attributes of those classes. See ``lightning.py`` for the user's view."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..core.accumulation import AccumulationWindow
from ..interface.config import ConfigError, ParallelConfig
from ..core.registry import default_registry
from ..distributed.launch import refuse
from .layout import make_config

PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "bf16-true": "bf16-true"}
STATE_FILE = "lightning.pt"
# set by the strategy's launcher in the environment of the ranks it starts: its process id (see _wait_to_be_ended)
LAUNCHER_ENV = "ULTRASCALE_LIGHTNING_LAUNCHER"
# how long a rank that Lightning's launcher started waits, once it has refused, for the launcher to end it
LAUNCHED_RANK_WAIT_S = 30.0


def check_precision(precision) -> None:
    if str(precision) not in PRECISIONS:
        raise ConfigError(f"precision={precision!r}: not available with the ultrascale strategy. Fix: use "
                          f"one of {', '.join(k for k in PRECISIONS if k != '32')}")


def _wait_to_be_ended() -> None:
    """In a rank Lightning's launcher started: wait (bounded) for the launcher to end this process. The launcher,
    rank 0, refuses the same layout and ends its ranks itself; a rank that exited first, with a failure status,
    would be taken by Lightning's process observer for a crash, and the observer kills rank 0 (SIGKILL) before it
    can say why."""
    parent = os.environ.get(LAUNCHER_ENV)
    if parent is None or not parent.isdigit():
        return
    deadline = time.monotonic() + LAUNCHED_RANK_WAIT_S
    while os.getppid() == int(parent) and time.monotonic() < deadline:
        time.sleep(0.05)


def find_causal_lm(module: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """(attribute name, model) of the LightningModule's Hugging Face causal LM, or a PEFT model of one (a direct
    child)."""
    from ..core.engine import causal_lm_of

    registry = default_registry()
    found = [(name, child) for name, child in module.named_children() if causal_lm_of(child, registry) is not None]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(n for n, _ in found)})"
        raise ConfigError(f"the LightningModule holds {what} Hugging Face causal LM(s) as attributes. Fix: assign "
                          "exactly one, e.g. self.model = AutoModelForCausalLM.from_config(...), in __init__ or "
                          "configure_model")
    return found[0]


def _plain(obj):
    """Lightning's checkpoint dict with dict subclasses (AttributeDict, OrderedDict) as plain dicts, so it loads
    with ``torch.load(weights_only=True)``."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj) if not hasattr(obj, "_fields") else tuple(_plain(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _plain(dataclasses.asdict(obj))
    return obj


class _UltraScalePrecisionMixin:
    """The precision plugin's logic, shared by ``lightning.pytorch`` and ``pytorch_lightning``: put it before
    the package's ``Precision`` in the bases (see ``UltraScalePrecision``)."""

    def __init__(self, precision: str = "32-true"):
        # the value is checked by the strategy (``check_precision``) when the Trainer is built, where the number of
        # processes is known: how a refusal is said depends on it
        super().__init__()
        self.precision = str(precision)
        self.strategy = None

    def convert_module(self, module):
        return module  # bf16-true is the layout's param_dtype: bf16, applied to the HF model as it is parallelized

    def clip_grad_by_norm(self, optimizer, clip_val, norm_type: float = 2.0) -> None:
        # the norm of the whole unsharded model: DTensor shards, pipeline stages and TP replicas counted once
        self.strategy.pmodel.clip_grad_norm_(float(clip_val), norm_type)


class _UltraScaleStrategyMixin:
    """The strategy's logic, shared by ``lightning.pytorch`` and ``pytorch_lightning``: put it before the
    package's ``ParallelStrategy`` in the bases, and set the class attributes below to that package's own
    pieces (see ``UltraScaleStrategy``)."""

    # set by the concrete class: the precision plugin class it pairs with, and its Lightning package's launcher,
    # process-group setup, all-reduce, rank-zero switch and optimizer wrapper
    _precision_class: type
    _launcher_class: type
    _init_dist_connection: Any
    _sync_ddp_if_available: Any
    _rank_zero_only: Any
    _lightning_optimizer_class: type

    strategy_name = "ultrascale"

    def __init__(self, config=None, *, preset: str | None = None, init_from: str | Path | None = None,
                 timeout: float | timedelta | None = None, accelerator=None, parallel_devices=None,
                 cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: str | None = None, **fields):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        try:
            known = default_registry().presets()
            if preset is not None and preset not in known:
                raise ConfigError(f"preset={preset!r}: unknown. Fix: one of {', '.join(known)}")
            if preset == "default" and config is None and not fields and os.environ.get("ULTRASCALE_CONFIG"):
                config, preset = os.environ["ULTRASCALE_CONFIG"], None
            self.preset = preset if (config is None and not fields) else None
            self.config = make_config(config, fields)
        except ConfigError as exc:
            refuse(exc)  # its own arguments, before it knows its devices: one line in a launched job
        self.init_from = init_from
        from ..distributed.launch import DEFAULT_TIMEOUT_S

        self._timeout = timeout if timeout is not None else DEFAULT_TIMEOUT_S
        self._process_group_backend = process_group_backend
        self.num_nodes = 1
        self.pmodel = None
        self.adapter = None
        self._attr = None
        self._checked_module = None  # the LightningModule whose model the layout was checked against

    # ---- processes ------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def world(self) -> int:
        return self.num_nodes * self.num_processes

    def _configure_launcher(self) -> None:
        # the precision and the layout are checked against the world size here, when the Trainer is built: in the
        # launching process, before any other rank or process group exists
        try:
            check_precision(self.precision_plugin.precision)
            if self.preset is None:
                self.config.resolve(self.world)
        except ConfigError as exc:
            self._refuse(exc)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self._launcher_class(self, self.cluster_environment, self.num_processes,
                                                  self.num_nodes)

    # ---- refusals ----------------------------------------------------------------------------------------
    def _refuse(self, exc: ConfigError) -> None:
        """A layout this job cannot run, said as every front end says it: in a job of several processes one line
        from global rank 0 (``launch.exit_on_error``) and status 2 from every process, with no traceback; the
        ranks Lightning's launcher started end before the command returns. In a single process, the
        ``ConfigError`` itself, for a caller to catch (as ``UltraScaleAccelerator`` does)."""
        from ..distributed.launch import exit_on_error

        if self.world <= 1:
            raise exc
        self._end_launched_ranks()
        if self._job_rank() != 0:
            _wait_to_be_ended()
            raise SystemExit(2)  # rank 0 says it (report_error reads RANK, which Lightning's launcher does not set)
        exit_on_error(exc)

    def _job_rank(self) -> int:
        """This process's global rank, with or without a process group, whoever started it."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        return self.node_rank * self.num_processes + self.local_rank

    def _end_launched_ranks(self) -> None:
        """End the ranks this process started with Lightning's launcher (they would only say the refusal again,
        or wait in a collective for this one) and wait for them, so none outlives the command. Lightning's process
        observer watches the launcher's list of processes and kills this process when one of them fails: the list
        is emptied first."""
        procs = list(getattr(self._launcher, "procs", None) or [])
        if not procs:
            return
        self._launcher.procs.clear()
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()

    def on_exception(self, exception: BaseException) -> None:
        # Lightning calls this for any exception in fit / validate / test / predict, on every rank: a refusal from
        # the layout's checks (before or after the process group, the engine's included) is said once
        super().on_exception(exception)
        if isinstance(exception, ConfigError):
            self._refuse(exception)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.world)
        self._rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        from ..distributed.launch import collective_timeout, set_collective_timeout

        self.set_world_ranks()
        self._check_model_before_processes()  # done already by this package's launcher in the launching process
        set_collective_timeout(self._timeout)
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        kwargs = {"timeout": collective_timeout()}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        self._init_dist_connection(self.cluster_environment, backend, **kwargs)

    def _check_model_before_processes(self) -> None:
        """Every check of the layout against the model that needs no process group (the engine's ``validate``:
        its config and module tree, e.g. ``ep`` against its experts, ``zero_stage`` for them, ``tp`` against its
        heads), run here, before this process joins the group, when the LightningModule already holds its causal
        LM; one built in ``configure_model`` (after this point) is checked in ``setup``, as is a layout the
        planner picks (``layout: auto``), which ``parallelize`` announces once."""
        from ..core.engine import causal_lm_of, validate

        module = self.lightning_module
        if module is None or module is self._checked_module:
            return
        found = [c for _, c in module.named_children() if causal_lm_of(c, default_registry()) is not None]
        if len(found) != 1:
            return  # none yet (configure_model), or several: find_causal_lm says so in setup
        self._checked_module = module
        model_config = causal_lm_of(found[0], default_registry()).config
        config = self.layout_for(model_config)
        if getattr(config, "layout", "manual") == "auto":
            return
        validate(config, model_config, self.world, model=found[0])
        if getattr(module, "_trainer", None) is not None:
            self._check_loop(config, module._trainer)

    @staticmethod
    def _check_loop(config, trainer) -> None:
        """Lightning's loop against the layout (``engine.validate_loop``): ``accumulate_grad_batches`` micro-batches
        per step, clipping when ``gradient_clip_val`` is set (by norm or by value: either needs every gradient)."""
        from ..core.engine import validate_loop

        validate_loop(config, trainer.accumulate_grad_batches, trainer.gradient_clip_val)

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning adds a DistributedSampler over distributed_sampler_kwargs

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank of one data-parallel replica (its TP, CP and pipeline peers) reads the same samples
        return {"num_replicas": self.pmodel.data_parallel_size, "rank": self.pmodel.data_parallel_rank}

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        # empty_init: parameters on the meta device; each rank then allocates only its shards (pretrained
        # weights from init_from or the config's directory)
        with torch.device("meta") if empty_init else contextlib.nullcontext():
            yield

    # ---- the model ------------------------------------------------------------------------------------
    @property
    def precision_plugin(self):
        return self._precision_plugin if self._precision_plugin is not None else self._precision_class()

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is not None and not isinstance(plugin, self._precision_class):
            plugin = self._precision_class(getattr(plugin, "precision", "32-true"))
        if plugin is not None:
            plugin.strategy = self
        self._precision_plugin = plugin

    def layout_for(self, model_config) -> ParallelConfig:
        config = self.config
        if self.preset is not None:
            config = default_registry().preset_config(self.preset, self.world, self.num_processes, model_config)
        mp = PRECISIONS[self.precision_plugin.precision]
        if mp == "bf16":
            config = config.replace(mixed_precision="bf16")
        elif mp == "bf16-true":  # the weights, gradients and optimizer states held in bf16
            config = config.replace(param_dtype="bf16")
        return config

    def setup(self, trainer) -> None:
        from ..checkpoints import load
        from .hf_module import ParallelCausalLM

        self.accelerator.setup(trainer)
        lm = self.lightning_module
        self._attr, hf = find_causal_lm(lm)
        config = self.layout_for(hf.config)
        self._check_loop(config, trainer)
        n_params = sum(p.numel() for p in hf.parameters())  # the whole model's (meta parameters included)
        self.pmodel = load.parallelize(hf, config, device=self.root_device, init_from=self.init_from)
        self._log_layout(hf, n_params)
        self.adapter = ParallelCausalLM(self.pmodel)
        setattr(lm, self._attr, self.adapter)
        self.model = lm
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
            self._prepare_optimizers()
        self.setup_precision_plugin()

    def _log_layout(self, hf, n_params: int) -> None:
        """The layout that runs, once for the job (global rank 0), as the command line logs it: a preset's or the
        planner's choice is visible, not only an explicit layout."""
        if self._job_rank() != 0:
            return
        chosen = f', chosen by strategy="{self._strategy_key()}"' if self.preset is not None else ""
        source = f" from {self.init_from}" if self.init_from else ""
        print(f"ultrascale: {self.world} processes, layout {self.pmodel.dims.describe()}{chosen}, model "
              f"{hf.config.model_type}{source} {n_params / 1e6:.2f}M params", file=sys.stderr, flush=True)

    def _strategy_key(self) -> str:
        return "ultrascale" if self.preset == "default" else f"ultrascale_{self.preset}"

    def _prepare_optimizers(self) -> None:
        """The user's optimizers go through the engine's optimizer path (``ParallelModel.prepare_optimizer``):
        under ZeRO-1 the data-parallel plugin rebuilds each as a ``ZeroRedundancyOptimizer`` of the same class and
        settings; LR schedulers follow their optimizer."""
        from ..core.engine import move_scheduler

        rebuilt = [self.pmodel.prepare_optimizer(opt) for opt in self.optimizers]
        for config in self.lr_scheduler_configs:
            for old, new in zip(self.optimizers, rebuilt):
                move_scheduler(config.scheduler, old, new)
        self.optimizers = rebuilt

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    # ---- the step -------------------------------------------------------------------------------------
    def training_step(self, *args, **kwargs):
        if self.adapter is not None:
            # Lightning's contract: the window's micro-batches weighted evenly (its loss / accumulate_grad_batches)
            self.adapter.loss_scale = AccumulationWindow.even(self.lightning_module.trainer.accumulate_grad_batches
                                                              ).take()
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self.adapter is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.adapter.apply_pending_grads():
            return closure_loss  # the pipeline schedule ran the backward inside the model call
        # the engine's backward around Lightning's (hooks, precision): then the gradient averaging over the axes
        # no wrapper reduces
        lightning_backward, out = super().backward, []
        self.pmodel.backward(closure_loss, backward_fn=lambda loss: out.append(
            lightning_backward(loss, optimizer, *args, **kwargs)))
        return out[0]

    @contextlib.contextmanager
    def block_backward_sync(self):
        # gradient accumulation: no data-parallel reduction until the window's last micro-batch. A pipeline
        # synchronises each call's own gradients instead (its backward runs inside the model call, and the
        # reductions are linear, so the sum of synchronised parts is the synchronised sum)
        with self.adapter.no_sync() if self.adapter is not None else contextlib.nullcontext():
            yield

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return self._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def broadcast(self, obj, src: int = 0):
        from ..distributed.launch import broadcast_object

        return broadcast_object(obj, src)

    def teardown(self) -> None:
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- checkpoints ----------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the sharded model

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # restored by load_checkpoint, in place, resharded if the layout changed

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the sharded model state is written by save_checkpoint

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def _other_state(self) -> dict[str, Any]:
        """The LightningModule's own parameters and buffers outside the HF model."""
        prefix = f"{self._attr}."
        return {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()
                if not k.startswith(prefix)}

    def _optimizer(self):
        if len(self.optimizers) > 1:
            raise ConfigError(f"{len(self.optimizers)} optimizers: checkpoints hold one. Fix: return one "
                              "optimizer from configure_optimizers")
        opt = self.optimizers[0] if self.optimizers else None
        return opt._optimizer if isinstance(opt, self._lightning_optimizer_class) else opt

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        from ..checkpoints.sharded import write_checkpoint

        if storage_options is not None:
            raise ConfigError("save_checkpoint(storage_options=...): sharded checkpoints are written by every "
                              "rank to a shared path. Fix: drop storage_options")
        path = Path(self.broadcast(str(filepath)))
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        rest["other_state_dict"] = self._other_state()
        write_checkpoint(self.pmodel, self._optimizer(), path, step=int(checkpoint.get("global_step", 0)),
                         files={STATE_FILE: _plain(rest)})

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        from ..checkpoints.sharded import load_checkpoint, read_file

        path = Path(self.broadcast(str(checkpoint_path)))
        load_checkpoint(self.pmodel, self._optimizer(), path)
        rest = read_file(path, STATE_FILE)
        other = rest.pop("other_state_dict", {})
        if other:
            self.lightning_module.load_state_dict(other, strict=False)
        rest["state_dict"] = {}
        return rest

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # done by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # done by load_checkpoint, resharded into this layout

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            import shutil

            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    @classmethod
    def register_strategies(cls, registry, connector=None) -> None:
        """The ``ultrascale_<preset>`` names in Lightning's ``registry``; with ``connector`` (the package's
        ``_AcceleratorConnector``) a misspelled one is refused naming the nearest (``refuse_misspelled_names``)."""
        for name, preset in default_registry().presets().items():  # the dimension plugins' presets: ultrascale_<name>
            key = "ultrascale" if name == "default" else f"ultrascale_{name}"
            registry.register(key, cls, description=preset.description, preset=name)
        if connector is not None:
            refuse_misspelled_names(connector, registry)


def refuse_misspelled_names(connector, registry) -> None:
    """Make the Trainer refuse a strategy name that starts with "ultrascale" but is not registered (a misspelled
    ``ultrascale_zero3``) naming the nearest registered one; Lightning's own error would list a few of its own
    names. Its check of the name (``connector._check_config_and_set_final_flags``, where the Trainer reads its
    flags) is wrapped so that this runs first; any other name is left to Lightning. A Lightning whose connector
    has no such method keeps its own error."""
    import difflib
    import functools

    check = getattr(connector, "_check_config_and_set_final_flags", None)
    if check is None or getattr(check, "_ultrascale_names", False):
        return

    @functools.wraps(check)
    def checked(self, *args, **kwargs):
        strategy = kwargs.get("strategy", args[0] if args else None)
        names = registry.available_strategies()
        if isinstance(strategy, str) and strategy.lower().startswith("ultrascale") and strategy.lower() not in names:
            ours = sorted(n for n in names if n.startswith("ultrascale"))
            close = difflib.get_close_matches(strategy.lower().replace("-", "_"), ours, n=1, cutoff=0.5)
            fix = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(ours)}"
            refuse(ConfigError(f"strategy={strategy!r}: no strategy of that name is registered. Fix: {fix}"))
        return check(self, *args, **kwargs)

    checked._ultrascale_names = True
    connector._check_config_and_set_final_flags = checked


class _UltraScaleLauncherMixin:
    """Lightning's own launcher (rank 0 is the user's process, which runs the script again for the other ranks of
    its node), put before the package's ``_SubprocessScriptLauncher`` in the bases: it checks the layout against
    the LightningModule's model before it starts any other process, so a refusal is said by the only process
    there is, and it tells the ranks it starts who started them (``LAUNCHER_ENV``)."""

    def __init__(self, strategy, *args):
        super().__init__(*args)
        self.strategy = strategy

    def launch(self, function, *args, trainer=None, **kwargs):
        self.strategy._check_model_before_processes()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _call_children_scripts(self) -> None:
        os.environ[LAUNCHER_ENV] = str(os.getpid())  # copied into each child's environment
        try:
            super()._call_children_scripts()
        finally:
            os.environ.pop(LAUNCHER_ENV, None)

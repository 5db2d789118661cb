"""Accelerate: every ultrascale layout behind a standard Accelerate loop, configured through Accelerate's own
YAML file and launched with ``accelerate launch``.

    from ultrascale_plugins.integrations.accelerate import UltraScaleAccelerator

    accelerator = UltraScaleAccelerator()              # the layout comes from the launch (see below)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Accelerate has no plugin mechanism, so the companion is a small ``Accelerator`` subclass. Before Accelerate sets
itself up it takes over what Accelerate would otherwise route through its FSDP plugin, its
``ParallelismConfig`` (which refuses CPU runs, has no pipeline axis and expects a tensor-parallel model) and its
autocast: the launcher's ``PARALLELISM_CONFIG_*``, ``FSDP_*`` and ``ACCELERATE_MIXED_PRECISION`` variables become
a ``ParallelConfig`` (see ``layout.py``) and are removed from this process's environment. ``prepare`` then
parallelizes the Hugging Face model through the engine and hands back a ``ParallelCausalLM`` (``model(**batch)``
returns the exact global-mean loss); the optimizer is re-pointed at the sharded parameters, the data loader is
sharded over data-parallel replicas only (TP/CP/pipeline peers read the same batches).

A layout that cannot run -- found when the Accelerator is built, or in ``prepare`` against the model -- is refused
in launched workers with one line for the whole job and exit status 2 (``launch.refuse``). On a machine without a GPU,
Accelerate's state is set up again for the launched job when something before it (``TrainingArguments``, a
``PartialState()``) set it up for one process (``forget_a_single_process_state``).

Pipeline parallel: the schedule runs forward and backward together inside ``model(**batch)``;
``accelerator.backward(loss)`` then adds those gradients, so the loop above is unchanged. Calling
``loss.backward()`` directly on a pipelined loss raises an error naming ``accelerator.backward``.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import InitProcessGroupKwargs

from ..core.accumulation import AccumulationWindow
from ..core.registry import default_registry
from ..interface.config import ConfigError, ParallelConfig
from .layout import ACCELERATE_ENV_PREFIXES, compile_from_dynamo, layout_from_environment, make_config

STATE_FILE = "accelerate.pt"


class UltraScalePlugin:
    """The layout for ``UltraScaleAccelerator``: a ``ParallelConfig`` / dict / YAML path, or ``None`` to read it
    from the launch (``$ULTRASCALE_CONFIG``, then Accelerate's own variables). ``init_from`` names a
    ``save_pretrained`` directory whose weights each rank loads shard by shard; ``timeout`` bounds every
    collective (seconds)."""

    def __init__(self, config: ParallelConfig | dict | str | Path | None = None, *, init_from: str | None = None,
                 timeout: float | None = None, **fields):
        from ..distributed.launch import refuse

        try:
            self.config = make_config(config, fields) if (config is not None or fields) else None
        except ConfigError as exc:  # a bad field (tpp=2): in launched workers one line from rank 0, exit status 2
            refuse(exc)
        self.init_from = init_from
        self.timeout = timeout


class UltraScaleAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` parallelizes Hugging Face causal LMs with ultrascale-plugins."""

    def __init__(self, *args, ultrascale_plugin: UltraScalePlugin | None = None, **kwargs):
        from ..distributed.launch import DEFAULT_TIMEOUT_S, refuse, set_collective_timeout, world_size
        from .cpu_relaunch import relaunch_cpu_workers

        # the model to check the layout against before Accelerate sets up (UltraScaleTrainer's; a plain Accelerate
        # loop makes its model after the Accelerator, and prepare checks it)
        model = kwargs.pop("_ultrascale_model", None)
        relaunch_cpu_workers()  # `accelerate launch --cpu --num_processes N` started one process: start N
        plugin = ultrascale_plugin or UltraScalePlugin()
        world = world_size()  # the launch's (or the process group's): Accelerate's state may not know it yet
        try:
            self.ultrascale_config = self._checked_layout(plugin, world, model, kwargs)
        except ConfigError as exc:
            refuse(exc, world)
        for key in [k for k in os.environ if k.startswith(ACCELERATE_ENV_PREFIXES)]:
            os.environ.pop(key)  # Accelerate must not build its own FSDP / ParallelismConfig / autocast
        timeout = plugin.timeout if plugin.timeout is not None else DEFAULT_TIMEOUT_S
        set_collective_timeout(timeout)
        handlers = list(kwargs.pop("kwargs_handlers", None) or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=timeout)))
        kwargs.setdefault("cpu", not torch.cuda.is_available() or os.environ.get("ULTRASCALE_DEVICE") == "cpu")
        if kwargs["cpu"]:
            forget_a_single_process_state(world)
        super().__init__(*args, kwargs_handlers=handlers, mixed_precision="no", **kwargs)
        if world > 1 and self.num_processes != world:
            refuse(ConfigError(f"Accelerate set itself up for {self.num_processes} process(es) "
                               f"({self.distributed_type}) but the launch started {world}, so every rank would "
                               "train on the same data. Fix: on a machine without a GPU leave cpu unset (or pass "
                               "cpu=True)"), world)
        self.ultrascale_plugin = plugin
        self.ultrascale_models: list = []  # ParallelCausalLM adapters prepared so far
        # models prepared for evaluation only (prepare_model(evaluation_mode=True): a trainer's frozen reference),
        # parallelized in the same layout; the step, clipping and checkpoints are the trained model's
        self.ultrascale_references: list = []

    @staticmethod
    def _checked_layout(plugin: UltraScalePlugin, world: int, model, kwargs: dict) -> ParallelConfig:
        """The layout, resolved against the world size and, when the model is known (UltraScaleTrainer's), checked
        against it, before any process group; ``mixed_precision`` is taken out of ``kwargs`` (it is the layout's)."""
        from ..core.engine import causal_lm_of, validate, validate_loop

        for taken in ("fsdp_plugin", "parallelism_config", "deepspeed_plugin", "megatron_lm_plugin"):
            if kwargs.get(taken) is not None:
                raise ConfigError(f"UltraScaleAccelerator({taken}=...): the layout is ultrascale's. Fix: describe it "
                                  "with UltraScalePlugin / the accelerate config file instead")
        mixed = kwargs.pop("mixed_precision", None)
        defaults = kwargs.pop("_ultrascale_defaults", None) or {}
        config = plugin.config
        if config is None:
            config = layout_from_environment(os.environ, world)
        # a front end's defaults (UltraScaleSFTTrainer: TRL's head runs in chunks) where the layout leaves the field
        # at its own default
        fresh = ParallelConfig()
        config = config.replace(**{k: v for k, v in defaults.items()
                                   if getattr(config, k) == getattr(fresh, k, None)})
        if mixed is not None and str(mixed) != "no":
            config = config.replace(mixed_precision=str(mixed))  # the data-parallel plugin checks the value
        compiled = compile_from_dynamo(kwargs.get("dynamo_plugin"), kwargs.get("dynamo_backend"), os.environ)
        if compiled is not None and config.compile == "none":
            config = config.replace(compile=compiled)  # Accelerate's own compile never sees our model
        resolved = config.resolve(world)  # degrees vs world size
        steps = kwargs.get("gradient_accumulation_steps") or 1
        plugin_steps = getattr(kwargs.get("gradient_accumulation_plugin"), "num_steps", None)
        validate_loop(resolved, plugin_steps or steps, None)  # clipping is a call: clip_grad_norm_ refuses it
        if causal_lm_of(model, default_registry()) is not None and getattr(resolved, "layout", "manual") != "auto":
            # and against the model: its config and module tree (ep vs its experts, tp vs its heads, ...)
            validate(resolved, causal_lm_of(model, default_registry()).config, world, model=model)
        return resolved

    # ---- prepare -----------------------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.ultrascale_config.dp

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel replica: the mesh's, once a model is prepared; before that (a data loader
        may be prepared first), this process's global rank in the layout's axis order. The rank and world size
        are the process group's (or the launcher's), never Accelerate's ``process_index``: whatever Accelerate
        decided about the device, data-parallel replicas read disjoint shards."""
        if self.ultrascale_models:
            return self.ultrascale_models[0].pmodel.data_parallel_rank
        from ..interface.parallel_dims import ParallelDims
        from ..distributed.launch import global_rank, world_size

        dims = ParallelDims(self.ultrascale_config, world_size())
        return dims.coordinate(global_rank(), dims.row_axes)

    def prepare(self, *args, device_placement=None):
        """Accelerate's ``prepare``, with Hugging Face causal LMs parallelized (and checked against the layout: a
        model the layout cannot run is refused once for the whole job in launched workers, see ``launch.refuse``)."""
        from ..distributed.launch import refuse, world_size

        try:
            return self._prepare(*args, device_placement=device_placement)
        except ConfigError as exc:
            refuse(exc, world_size())

    def _prepare(self, *args, device_placement=None):
        from ..core.engine import causal_lm_of

        # models first: the optimizer must be re-pointed at the sharded parameters
        originals: set[int] = set()
        names: dict[int, list[str]] = {}  # every name of every parameter (a tied weight has two)
        out = list(args)
        for i, obj in enumerate(args):
            if causal_lm_of(obj, default_registry()) is not None:  # a Hugging Face causal LM, or a PEFT model of one
                originals.add(i)
                for n, p in obj.named_parameters(remove_duplicate=False):
                    names.setdefault(id(p), []).append(n)
                # prepared before (a trainer that ran its model ahead of training): the same adapter
                out[i] = next((a for a in self.ultrascale_models if a.pmodel.module is obj), None) or \
                    self._parallelize(obj)
        from ..core.engine import move_scheduler

        rest, replaced = [], {}
        for i, obj in enumerate(out):
            if isinstance(obj, torch.optim.Optimizer) and names:
                out[i] = self._repoint(obj, names)
                replaced[id(obj)] = (obj, out[i])
            if i not in originals:
                rest.append(i)
        for obj in out:  # a scheduler built on an optimizer that ZeRO-1 replaced follows it
            old = getattr(obj, "optimizer", None)
            if id(old) in replaced and not isinstance(obj, torch.optim.Optimizer):
                move_scheduler(obj, *replaced[id(old)])
        prepared = super().prepare(*[out[i] for i in rest], device_placement=device_placement) if rest else ()
        prepared = prepared if isinstance(prepared, tuple) else (prepared,)
        for i, obj in zip(rest, prepared):
            out[i] = obj
        return out[0] if len(out) == 1 else tuple(out)

    def _parallelize(self, model, reference: bool = False):
        from ..checkpoints import load
        from ..core.engine import causal_lm_of
        from .hf_module import ParallelCausalLM

        if not hasattr(model, "lm_head"):
            raise ConfigError(f"{type(model).__name__}: ultrascale parallelizes causal LMs (a model with an "
                              "lm_head). Fix: prepare an AutoModelForCausalLM")
        init_from = self.ultrascale_plugin.init_from
        if reference and not any(p.is_meta for p in model.parameters()):
            init_from = None  # a reference loaded whole keeps its own weights
        n_params = sum(p.numel() for p in model.parameters())  # the whole model's (meta parameters included)
        pmodel = load.parallelize(model, self.ultrascale_config, device=self.device, init_from=init_from)
        adapter = ParallelCausalLM(pmodel)
        if reference:
            self.ultrascale_references.append(adapter)
            return adapter
        self._log_layout(pmodel, causal_lm_of(model, default_registry()).config.model_type, n_params)
        # Accelerate's contract: the window's micro-batches weighted evenly (its loss / gradient_accumulation_steps)
        adapter.loss_scale = AccumulationWindow.even(self.gradient_accumulation_steps).take()
        self.ultrascale_models.append(adapter)
        self._models.append(adapter)
        return adapter

    def _log_layout(self, pmodel, model_type: str, n_params: int) -> None:
        """The layout that trains, once for the job (global rank 0), as the command line and Lightning log it: the
        mesh and every feature the layout turned on (``ParallelDims.describe``), whether it came from the launch,
        the file or ``UltraScalePlugin``. On standard error, as Lightning's: a script's own output stays its own."""
        import sys

        from ..distributed.launch import global_rank, world_size

        if global_rank() != 0:
            return
        source = f" from {self.ultrascale_plugin.init_from}" if self.ultrascale_plugin.init_from else ""
        print(f"ultrascale: {world_size()} processes, layout {pmodel.dims.describe()}, model "
              f"{model_type}{source} {n_params / 1e6:.2f}M params", file=sys.stderr, flush=True)

    def _repoint(self, optimizer, names: dict[int, list[str]]):
        """An optimizer built on the unparallelized model's parameters now holds this rank's sharded ones (a
        pipeline rank keeps only its stages'). ZeRO-1 turns it into a ZeroRedundancyOptimizer."""
        current = {}
        for adapter in self.ultrascale_models:
            for part in adapter.pmodel.modules:
                for n, p in part.named_parameters(remove_duplicate=False):
                    current.setdefault(n, p)
        for group in optimizer.param_groups:
            seen, params = set(), []
            for p in group["params"]:
                # a pipeline stage may hold a tied weight under only one of its names (embedding or head)
                new = next((current[n] for n in names.get(id(p), []) if n in current), None)
                if new is not None and id(new) not in seen:
                    seen.add(id(new))
                    params.append(new)
            group["params"] = params
        if optimizer.state:
            raise ConfigError("prepare(): the optimizer has already taken steps. Fix: prepare it before training")
        return self.ultrascale_models[-1].pmodel.prepare_optimizer(optimizer)  # ZeRO-1 partitions it

    def prepare_model(self, model, device_placement=None, evaluation_mode: bool = False):
        """Accelerate's, but a Hugging Face causal LM prepared for evaluation only (TRL's DPO reference model) is
        parallelized in the layout, frozen and in eval mode: each rank keeps its shards of it, as of the trained
        model. It never trains: it is not among ``ultrascale_models``."""
        from ..core.engine import causal_lm_of
        from ..distributed.launch import refuse, world_size

        if not evaluation_mode or causal_lm_of(model, default_registry()) is None:
            return super().prepare_model(model, device_placement, evaluation_mode)
        model.requires_grad_(False)
        model.eval()
        try:
            adapter = self._parallelize(model, reference=True)
        except ConfigError as exc:
            refuse(exc, world_size())
        return adapter.eval()

    def prepare_optimizer(self, optimizer, device_placement=None):
        if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
            device_placement = False  # moving it would read a state dict that is partitioned over the ranks
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        from accelerate.data_loader import prepare_data_loader

        if getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if device_placement is None:
            device_placement = self.device_placement
        # one shard per data-parallel replica: the TP / context / pipeline peers of a replica read the same data
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=self.data_parallel_size, process_index=self.data_parallel_rank,
            split_batches=self.split_batches, put_on_device=device_placement, rng_types=self.rng_types.copy(),
            dispatch_batches=self.dispatch_batches, even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler):
        prepared = super().prepare_scheduler(scheduler)
        prepared.__class__ = _ReplicaScheduler
        prepared.replicas = self.data_parallel_size
        return prepared

    # ---- the step ----------------------------------------------------------------------------------------
    def _adapter(self, model=None):
        if model is not None:
            return model if model in self.ultrascale_models else None
        return self.ultrascale_models[0] if len(self.ultrascale_models) == 1 else None

    def backward(self, loss, **kwargs):
        adapter = self._adapter()
        if adapter is None:
            return super().backward(loss, **kwargs)
        if adapter.apply_pending_grads():
            return  # the pipeline schedule ran the backward inside the model call
        adapter.pmodel.backward(loss, backward_fn=lambda value: super(UltraScaleAccelerator, self).backward(
            value, **kwargs))

    @contextlib.contextmanager
    def no_sync(self, model):
        adapter = self._adapter(model)
        if adapter is None:
            with super().no_sync(model):
                yield
            return
        with adapter.no_sync():
            yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        adapter = self._adapter()
        if adapter is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        # the norm of the whole unsharded model: DTensor shards, pipeline stages and TP replicas counted once
        return adapter.pmodel.clip_grad_norm_(float(max_norm), norm_type)

    def gather(self, tensor):
        """Concatenate ``tensor`` from every data-parallel replica (TP / context / pipeline peers hold the same
        values, so they are counted once)."""
        if self._adapter() is None or self.data_parallel_size == self.num_processes:
            return super().gather(tensor)
        from accelerate.utils import recursively_apply

        dims = self._adapter().pmodel.dims
        group = dims.group(dims.row_axes)
        size = self.data_parallel_size

        def one(t):
            t = t.contiguous() if t.dim() else t.reshape(1)
            parts = [torch.empty_like(t) for _ in range(size)]
            if size > 1:
                torch.distributed.all_gather(parts, t, group=group)
            else:
                parts = [t]
            return torch.cat(parts)

        return recursively_apply(one, tensor, error_on_other_type=True)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if model in self.ultrascale_models:
            return model  # the adapter: save_pretrained, config, generation of the whole model are on it
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap=True):
        """Full tensors, gathered on every rank (pipeline stages included). For large models prefer
        ``save_model`` / ``save_pretrained``, which stream."""
        adapter = self._adapter(model)
        if adapter is None:
            return super().get_state_dict(model, unwrap)
        return adapter.pmodel.full_state_dict()

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        adapter = self._adapter(model)
        if adapter is None:
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        adapter.save_pretrained(save_directory, max_shard_size=max_shard_size)

    # ---- checkpoints -------------------------------------------------------------------------------------
    def _optimizer(self):
        if len(self._optimizers) > 1:
            raise ConfigError(f"{len(self._optimizers)} optimizers were prepared: a checkpoint holds one. Fix: "
                              "prepare one optimizer")
        return self._optimizers[0].optimizer if self._optimizers else None

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, *, _before_commit=None,
                   **kwargs):
        """A sharded checkpoint (model, optimizer, schedulers, RNG, step, registered objects) written by every
        rank in parallel and committed atomically at ``output_dir``. (``_before_commit``: UltraScaleTrainer's
        files, added before the commit.)"""
        adapter = self._adapter()
        if adapter is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        from ..checkpoints.sharded import write_checkpoint

        if output_dir is None:
            raise ConfigError("save_state(): pass output_dir (a directory for the sharded checkpoint)")
        output_dir = Path(self._broadcast_path(output_dir))
        extra = {"step": self.step, "schedulers": [s.state_dict() for s in self._schedulers],
                 "custom": [obj.state_dict() for obj in self._custom_objects],
                 "dataloaders": [dl.state_dict() for dl in self._dataloaders if hasattr(dl, "state_dict")
                                 and self.use_stateful_dataloader]}
        write_checkpoint(adapter.pmodel, self._optimizer(), output_dir, step=int(self.step),
                         files={STATE_FILE: extra}, before_commit=_before_commit)
        return str(output_dir)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs):
        adapter = self._adapter()
        if adapter is None:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        from ..checkpoints.sharded import load_checkpoint, read_file

        if input_dir is None:
            raise ConfigError("load_state(): pass input_dir (a directory written by save_state)")
        path = Path(input_dir)
        load_checkpoint(adapter.pmodel, self._optimizer(), path)
        extra = read_file(path, STATE_FILE)
        for sched, state in zip(self._schedulers, extra["schedulers"]):
            sched.load_state_dict(state)
        for obj, state in zip(self._custom_objects, extra["custom"]):
            obj.load_state_dict(state)
        for dl, state in zip([d for d in self._dataloaders if hasattr(d, "load_state_dict")], extra["dataloaders"]):
            dl.load_state_dict(state)
        self.step = extra["step"]

    def _broadcast_path(self, path) -> str:
        from ..distributed.launch import broadcast_object

        return broadcast_object(str(path))


def forget_a_single_process_state(world: int) -> None:
    """Let Accelerate set itself up again when what set it up first saw one process where the launch has ``world``.

    ``TrainingArguments`` sets up Accelerate's shared state when it is built. On a machine without a GPU and
    without ``use_cpu=True`` (its default) that state is ``DistributedType.NO`` -- process index 0 of 1 -- on every
    rank of a torchrun / ``accelerate launch`` job, although Accelerate has started the job's process group: every
    rank would take the first data shard and call itself the main process (logging, ``trainer_state.json``,
    checkpoint rotation, one ``rng_state.pth`` for all). A user's own ``PartialState()`` before the Accelerator
    does the same. The state is one dictionary shared by every ``PartialState`` (``TrainingArguments``' included),
    so clearing it lets this Accelerator build it again, on CPU, from the process group, and everything that
    reads it -- Trainer's ``args.world_size`` and ``args.process_index`` too -- sees the real job."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    state = PartialState._shared_state
    if world > 1 and state and state.get("distributed_type") == DistributedType.NO:
        AcceleratorState._reset_state(reset_partial_state=True)


class _ReplicaScheduler(AcceleratedScheduler):
    """Accelerate steps a scheduler once per process per optimizer step (the global batch grows with the
    processes); with TP / CP / pipeline peers sharing a batch, it grows with the data-parallel replicas."""

    replicas = 1

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer or self.split_batches:
            return super().step(*args, **kwargs)
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.replicas):
            self.scheduler.step(*args, **kwargs)


__all__ = ["UltraScaleAccelerator", "UltraScalePlugin"]

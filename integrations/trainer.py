"""``transformers.Trainer`` on any ultrascale layout: a ``Trainer`` whose Accelerator is ``UltraScaleAccelerator``.

    from ultrascale_plugins.integrations.trainer import UltraScaleTrainer
    args = TrainingArguments(..., save_strategy="steps", save_steps=500, save_total_limit=3)
    trainer = UltraScaleTrainer(model=model, args=args, train_dataset=ds, ultrascale_plugin=UltraScalePlugin(tp=2))
    trainer.train()                                  # or trainer.train(resume_from_checkpoint=True)
    trainer.save_model("out/")                       # every rank calls save_model (it streams shards)

The layout comes from ``ultrascale_plugin`` or, like any Accelerate run, from the launch (``ultrascale
accelerate-launch F.yaml train.py``). ``create_accelerator_and_postprocess`` builds the ``UltraScaleAccelerator``
itself, from the arguments a ``Trainer`` gives its ``Accelerator``; Trainer's own FSDP / DeepSpeed /
``parallelism_config`` arguments are refused (the layout is ultrascale's).

What works: training (loss, gradient accumulation, ``max_grad_norm``, ``bf16=True``), logging, evaluation loss,
``save_model`` (a ``from_pretrained`` directory with the tokenizer and ``training_args.bin``, as Trainer's; pushed
by ``push_to_hub``), and checkpoints during training (``save_strategy`` "steps",
"epoch" or "best", ``save_total_limit``, ``load_best_model_at_end``, ``resume_from_checkpoint=PATH or True``).

A checkpoint is Trainer's ``{output_dir}/checkpoint-{step}`` directory holding the package's sharded checkpoint
(``UltraScaleAccelerator.save_state``: model and optimizer shards written by every rank, ``ultrascale.json``)
plus Trainer's own ``trainer_state.json``, ``scheduler.pt`` and ``rng_state*.pth`` files, written together and
committed once (``checkpoint.commit``: the package's one commit), so a run that fails while saving leaves every
earlier checkpoint (one of the same name included) as it was. Resuming loads the shards into
the current layout (any layout: DCP reshards), the scheduler, the RNG and ``TrainerState``; Trainer then skips the
batches already consumed. With ``save_only_model=True`` a checkpoint holds the model shards and Trainer's state
only (resuming from it restarts the optimizer, as with a plain Trainer).

Once ``train()`` has prepared the model, evaluation and prediction run the parallelized model (``self.model``
stays the Hugging Face module Trainer was given); an ``evaluate()`` before any ``train()`` runs that module
unparallelized on every rank, as a plain Trainer would.

Gradient accumulation is Trainer's: the window's loss is its summed token losses over its valid tokens (what a
plain Trainer does with ``num_items_in_batch``), on every layout, pipelines included.
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings

import torch
from transformers import Trainer

from ..core.accumulation import AccumulationWindow
from ..interface.config import ConfigError
from .accelerate import STATE_FILE, UltraScaleAccelerator, UltraScalePlugin

TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer's names for these files (5.17 to 5.25)
TRAINING_ARGS_NAME = "training_args.bin"
SCHEDULER_NAME = "scheduler.pt"
CHECKPOINT_PREFIX = "checkpoint"


def is_sharded_checkpoint(path) -> bool:
    """A directory written by the package's ``write_checkpoint`` (``UltraScaleAccelerator.save_state``)."""
    from ..checkpoints.sharded import META

    return path is not None and os.path.isfile(os.path.join(str(path), META))


class UltraScaleTrainer(Trainer):
    def __init__(self, *args, ultrascale_plugin: UltraScalePlugin | None = None, **kwargs):
        from . import trl_contract

        # built on a TRL trainer: one whose contract is known (integrations/trl.py: SFTTrainer, DPOTrainer), or
        # refused
        from ..distributed.launch import refuse

        try:
            self._trl = trl_contract.trl_kind(type(self))
            if self._trl:
                trl_contract.before_init(self._trl, args, kwargs, ultrascale_plugin)
        except ConfigError as exc:  # in launched workers one line from rank 0 and exit status 2, not a traceback
            refuse(exc)
        self.ultrascale_plugin = ultrascale_plugin or UltraScalePlugin()
        self._initializing = True  # DPO's reference log-probabilities wait for the parallel model (train)
        self._pending_references: list[tuple[str, int]] = []
        super().__init__(*args, **kwargs)
        self._initializing = False
        if self._trl:
            trl_contract.after_init(self)
        # the adapter's loss is already a micro-batch's global mean over its valid tokens: it takes no
        # num_items_in_batch; the accumulation window is weighted by tokens in training_step instead
        self.model_accepts_loss_kwargs = False
        self._window: AccumulationWindow | None = None  # the accumulation window being run

    # ---- the accelerator ---------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """What ``Trainer.create_accelerator_and_postprocess`` does, with ``UltraScaleAccelerator`` as the class:
        Trainer accumulates gradients itself (Accelerate's ``num_steps`` is 1), the data loader settings come
        from ``accelerator_config``, the rest from ``Trainer._build_accelerator_args``."""
        from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

        from ..core.engine import validate_loop
        from ..distributed.launch import refuse, world_size

        if self.args.fsdp_plugin_args is not None:
            refuse(ConfigError("UltraScaleTrainer with TrainingArguments(fsdp=...): the layout is ultrascale's. "
                               "Fix: drop fsdp / fsdp_config and describe the layout with UltraScalePlugin (e.g. "
                               "UltraScalePlugin(dp_shard=N) for ZeRO-3)"), world_size())
        grad_acc_kwargs = dict(self.args.accelerator_config.gradient_accumulation_kwargs or {})
        if "num_steps" in grad_acc_kwargs:
            if self.args.gradient_accumulation_steps > 1:
                raise ValueError("The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is "
                                 "greater than 1 in the passed `TrainingArguments`: set only one of them")
            self.args.gradient_accumulation_steps = grad_acc_kwargs["num_steps"]
        grad_acc_kwargs["num_steps"] = 1  # Trainer divides the loss by its accumulation steps itself

        accelerator_config = self.args.accelerator_config.to_dict()
        dataloader_config = DataLoaderConfiguration(**{key: accelerator_config.pop(key) for key in (
            "split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler")})
        dataloader_config.data_seed = self.args.data_seed
        dataloader_config.non_blocking = accelerator_config.pop("non_blocking")

        args = self._build_accelerator_args(dataloader_config=dataloader_config,
                                            gradient_accumulation_plugin=GradientAccumulationPlugin(**grad_acc_kwargs))
        # Trainer holds its model already: the layout is checked against it before Accelerate sets up (and before
        # its process group, unless TrainingArguments started one), one line from rank 0 if it cannot run
        self.accelerator = UltraScaleAccelerator(ultrascale_plugin=self.ultrascale_plugin,
                                                 _ultrascale_model=self.model,
                                                 _ultrascale_defaults=self._ultrascale_defaults(), **args)
        try:  # the Trainer's own loop: its accumulation and clipping (max_grad_norm, 1.0 by default)
            validate_loop(self.accelerator.ultrascale_config, self.args.gradient_accumulation_steps,
                          self.args.max_grad_norm)
        except ConfigError as exc:
            refuse(exc, world_size())
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)
        # UltraScaleAccelerator refuses DeepSpeed and FSDP plugins: neither of Trainer's code paths for them applies
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False

    def _move_model_to_device(self, model, device):
        """Trainer's ``model.to(device)``, but not for a model built on the meta device (``init_from``): the layout
        gives each rank storage for its own shards only, on its device (``.to`` of a meta tensor fails)."""
        if any(p.is_meta for p in model.parameters()):
            return
        return super()._move_model_to_device(model, device)

    def _ultrascale_defaults(self) -> dict:
        """Layout fields this trainer sets where the layout leaves them at their default: TRL's SFTTrainer and
        DPOTrainer compute their loss through a fused, chunked head, so the parallel model's head runs in chunks
        too."""
        from .trl_contract import DEFAULT_CHUNK

        return {"chunked_loss": DEFAULT_CHUNK} if self._trl else {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's (or the Trainer subclass's); TRL's SFTTrainer's and DPOTrainer's from the parallel model's
        per-token outputs (integrations/trl_contract.py)."""
        if self._trl:
            from . import trl_contract

            loss = trl_contract.compute_loss if self._trl == "sft" else trl_contract.dpo_compute_loss
            return loss(self, model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """TRL's DPOTrainer (``precompute_ref_log_probs``) computes the reference's log-probabilities in its
        ``__init__``, before anything is parallelized: here they wait for the parallel model, computed at the start
        of ``train`` (or of an ``evaluate`` before it) in the layout (``trl_contract.precompute_reference``)."""
        if self._trl != "dpo":
            return super()._precompute_ref_logps(dataset, name, batch_size)
        if self._initializing:
            self._pending_references.append((name, batch_size))
            return dataset
        from .trl_contract import precompute_reference

        return precompute_reference(self, dataset, batch_size)

    def _precompute_pending(self) -> None:
        """The reference log-probabilities ``_precompute_ref_logps`` set aside, now, into the datasets."""
        pending, self._pending_references = self._pending_references, []
        for name, batch_size in pending:
            if name == "train":
                self.train_dataset = self._precompute_ref_logps(self.train_dataset, name, batch_size)
            elif isinstance(self.eval_dataset, dict):
                self.eval_dataset[name] = self._precompute_ref_logps(self.eval_dataset[name], name, batch_size)
            else:
                self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, name, batch_size)

    def evaluate(self, *args, **kwargs):
        self._precompute_pending()
        return super().evaluate(*args, **kwargs)

    def get_total_train_batch_size(self, args) -> int:
        """The distinct rows of one optimizer step over the whole job, which ``train_samples_per_second`` and the
        epoch count are made of: the data-parallel replicas' (TP, context and pipeline peers read the same rows),
        where Trainer would multiply by every process but the tensor-parallel ones it knows of."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.accelerator.data_parallel_size

    def _ultrascale_adapter(self):
        adapters = self.accelerator.ultrascale_models
        if len(adapters) > 1:
            raise ConfigError(f"{len(adapters)} models were prepared: a Trainer checkpoint holds one")
        return adapters[0] if adapters else None

    # ---- the step ----------------------------------------------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """Once prepared, the model that runs is the parallelized one: ``self.model`` stays the Hugging Face
        module Trainer was given, so evaluation / prediction (which start from it) are handed the adapter. A model
        parallelized before training had an optimizer (DPO's precomputed reference log-probabilities) goes through
        Trainer's ``prepare`` once more, which hands back the same adapter with the optimizer prepared."""
        adapter = self._ultrascale_adapter()
        if adapter is not None and model is self.model and (not training or self.accelerator._optimizers):
            return adapter
        return super()._wrap_model(model, training, dataloader)

    def get_batch_samples(self, *args, **kwargs):
        """Trainer's accumulation window, plus each micro-batch's share of the window's valid tokens on all
        data-parallel ranks (``pmodel.tokens.shares``, as the command line weights its micro-batches):
        a plain Trainer divides the window's summed token losses by ``num_items_in_batch``, and so does this one,
        whatever the layout. Trainer's own count cannot be used: it gathers over every process, and ranks of a
        tensor-, context- or pipeline-parallel group hold the same rows."""
        batch_samples, num_items_in_batch = super().get_batch_samples(*args, **kwargs)
        adapter = self._ultrascale_adapter()
        self._window = None
        if adapter is not None and batch_samples and all(isinstance(b, dict) and "labels" in b
                                                         for b in batch_samples):
            self._window = AccumulationWindow.by_tokens(adapter.pmodel, batch_samples)
        return batch_samples, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step with the micro-batch weighted by its share of the window's valid tokens (without
        labels in the batch: 1 / the micro-batches, as Trainer does). Trainer divides the loss by
        ``current_gradient_accumulation_steps``, so that divisor is set to 1 / share for the call; a pipeline's
        backward runs inside the call, so its ``loss_scale`` is the share."""
        steps = self.current_gradient_accumulation_steps
        share = self._window.take() if self._window is not None else None
        share = 1.0 / steps if share is None else share
        for adapter in self.accelerator.ultrascale_models:
            adapter.loss_scale = share
        self.current_gradient_accumulation_steps = 1.0 / share if share else float("inf")
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.current_gradient_accumulation_steps = steps

    def train(self, *args, **kwargs):
        """Trainer's ``train``, after finishing what a crash in the middle of a checkpoint's commit left in
        ``output_dir`` (``checkpoint.recover``), so that ``resume_from_checkpoint=True`` finds the newest
        complete one."""
        from ..checkpoints.sharded import recover

        recover(self.args.output_dir)
        self._precompute_pending()
        return super().train(*args, **kwargs)

    # ---- saving ------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        adapters = self.accelerator.ultrascale_models
        if not adapters:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        adapters[0].save_pretrained(output_dir)  # collective: every rank writes its shards
        if self.args.should_save:  # what Trainer's _save writes beside the weights
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model, trial) -> None:
        """``Trainer._save_checkpoint`` with the sharded checkpoint in place of the full model / optimizer files.
        Collective: every rank writes its shards. The directory is assembled under a hidden name and renamed
        into place once complete (an earlier checkpoint of the same name is replaced only then)."""
        adapter = self._ultrascale_adapter()
        if adapter is None:
            return super()._save_checkpoint(model, trial)
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy

        from ..checkpoints.sharded import write_checkpoint

        folder = f"{CHECKPOINT_PREFIX}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        if self._trl:  # TRL's trainers write their model card (README.md in output_dir) at every checkpoint
            from .trl_contract import write_model_card

            write_model_card(self)
        output_dir = os.path.join(run_dir, folder)
        main = self.accelerator.is_main_process

        def trainer_files(directory) -> None:
            """Trainer's own files beside the shards, in the directory being committed (every rank)."""
            if not self.args.save_only_model:
                self._save_optimizer_and_scheduler(str(directory))
                self._save_scaler(str(directory))
                self._save_rng_state(str(directory))
            if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and \
                    self.state.best_global_step:
                best = os.path.join(run_dir, f"{CHECKPOINT_PREFIX}-{self.state.best_global_step}")
                if self.state.best_global_step == self.state.global_step or os.path.exists(best):
                    self.state.best_model_checkpoint = best
            if main:
                for cb in [cb for cb in self.callback_handler.callbacks + [self.control]
                           if isinstance(cb, ExportableState)]:
                    name, cb_state = cb.__class__.__name__, cb.state()
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(cb_state)
                    else:
                        self.state.stateful_callbacks[name] = cb_state
                self.state.save_to_json(os.path.join(str(directory), TRAINER_STATE_NAME))

        # one commit for the shards and Trainer's files: the checkpoint is complete at checkpoint-N, or absent
        if self.args.save_only_model:
            write_checkpoint(adapter.pmodel, None, self.accelerator._broadcast_path(output_dir),
                             step=int(self.state.global_step), before_commit=trainer_files)
        else:
            self.accelerator.save_state(output_dir, _before_commit=trainer_files)

        if self.args.push_to_hub:
            self._push_from_checkpoint(output_dir)
        if main:
            self._rotate(run_dir)
        self.accelerator.wait_for_everyone()

    def _rotate(self, run_dir: str) -> None:
        """Keep ``save_total_limit`` checkpoints (the newest and the best always stay), as Trainer does."""
        from transformers.trainer_utils import rotate_checkpoints

        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer state is in the sharded checkpoint (``_save_checkpoint``); the scheduler is Trainer's
        ``scheduler.pt``."""
        if self._ultrascale_adapter() is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.accelerator.is_main_process and self.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's "please also save the optimizer state" warning
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ---- resuming ----------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Trainer loads a checkpoint's weights into the unparallelized model before ``prepare``; a sharded one
        is loaded after it, with the optimizer (``_load_optimizer_and_scheduler``)."""
        if not is_sharded_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):
            raise ConfigError(f"resume_from_checkpoint='{resume_from_checkpoint}': a sharded checkpoint without "
                              f"{TRAINER_STATE_NAME} (not written by a Trainer). Fix: resume from a checkpoint-N "
                              "directory of a Trainer run, or load it with UltraScaleAccelerator.load_state")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_sharded_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        from ..checkpoints.sharded import load_checkpoint, read_meta

        adapter = self._ultrascale_adapter()
        if adapter is None:
            raise ConfigError(f"resume_from_checkpoint='{checkpoint}': no model was prepared by the "
                              "UltraScaleAccelerator to load it into")
        meta = read_meta(checkpoint)
        if meta["optimizer"]["class"] is None or not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
            load_checkpoint(adapter.pmodel, None, checkpoint)  # save_only_model: weights only
        else:
            self.accelerator.load_state(checkpoint)  # model, optimizer (in this layout), each rank's RNG
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        path = self.state.best_model_checkpoint
        adapter = self._ultrascale_adapter()
        if adapter is None or not is_sharded_checkpoint(path):
            return super()._load_best_model()
        from ..checkpoints.sharded import load_checkpoint

        # the weights only: the random state goes on from the end of training, not from the checkpoint's
        rng = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        load_checkpoint(adapter.pmodel, None, path)
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


__all__ = ["UltraScaleTrainer", "is_sharded_checkpoint"]

"""The training loop of a recipe, in the pieces every run has: the optimizer and its learning-rate schedule, the data
(this rank's rows of each step, resumable), the accumulation window of one optimizer step, the checkpoint cadence,
the loop itself and the validation after it."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path

import torch

from .. import _timing_mark
from ..core.accumulation import AccumulationWindow
from ..data.recipe import Recipe
from ..data.recipe_data import TrainingData
from ..interface.config import ConfigError
from ..interface.extras import install_command


def make_optimizer(pmodel, recipe: Recipe):
    """The recipe's AdamW: torch's fused one (one kernel per parameter group; every parameter is a DTensor under
    TP, so it composes), or torchao's where the recipe asks for low-bit states or stochastic rounding."""
    t = recipe.train
    cls, flags = optimizer_class(t.optimizer, t.bf16_stochastic_round)
    return pmodel.build_optimizer(cls, lr=t.lr, weight_decay=t.weight_decay, **flags)


def check_optimizer(name: str, stochastic_round: bool, config) -> None:
    """Before launch: torchao is installed for the recipe's optimizer, and its low-bit states can hold this
    layout's weights."""
    from ..interface.facts import layout_facts

    optimizer_class(name, stochastic_round)
    facts = layout_facts(config)
    dtensors = facts.states_sharded or any(facts.degree(a) > 1 for a in ("tp", "ep"))
    if name != "adamw" and facts.param_bytes == 2 and dtensors:
        raise ConfigError(f"train.optimizer={name}: torchao's low-bit states of bf16 weights fail in its compiled "
                          "step when the weights are DTensors, as this layout's are (sharded by FSDP2 or tensor "
                          "parallel): torchao 0.18 on torch 2.13 has no aten.view.dtype for them. Fix: use "
                          "parallel.param_dtype: fp32 with low-bit states, or optimizer: adamw with "
                          "bf16_stochastic_round: true")


def optimizer_class(name: str, stochastic_round: bool):
    """(optimizer class, its flags) for ``train.optimizer`` and ``train.bf16_stochastic_round``. torchao's classes:
    ``AdamW8bit`` and ``AdamW4bit`` (DTensor-aware: states sharded with the weights), ``_AdamW`` for stochastic
    rounding alone (torchao 0.18 keeps its name private, and documents it for bf16 training)."""
    if name == "adamw" and not stochastic_round:
        return torch.optim.AdamW, {"fused": True}
    try:
        import torchao.optim as ao
    except ImportError:
        raise ConfigError(f"train.optimizer={name}{', bf16_stochastic_round' if stochastic_round else ''}: needs "
                          f"torchao. Fix: {install_command('float8')}") from None
    cls = {"adamw": getattr(ao, "_AdamW", None), "adamw_8bit": ao.AdamW8bit, "adamw_4bit": ao.AdamW4bit}[name]
    if cls is None:
        raise ConfigError("train.bf16_stochastic_round=true: this torchao has no AdamW with stochastic rounding "
                          "(torchao.optim._AdamW). Fix: pip install \"torchao>=0.18\", or bf16_stochastic_round: false")
    return cls, ({"bf16_stochastic_round": True} if stochastic_round else {})


def set_lr(group: dict, lr: float) -> None:
    """A parameter group's learning rate: in place where the optimizer keeps it as a tensor (torchao's)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def lr_at(step: int, recipe: Recipe) -> float:
    t = recipe.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def training_data(recipe: Recipe, pmodel) -> tuple[Recipe, TrainingData]:
    """(the recipe with ``train.epochs`` turned into steps, what the loop reads), the batch split checked against
    the layout that runs it."""
    data = TrainingData(recipe)  # recipe.init_from: the tokenizer's default directory
    if recipe.train.epochs:  # the steps of train.epochs passes over the dataset
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, steps=data.steps))
    t, dp_size = recipe.train, pmodel.data_parallel_size
    if dp_size * t.micro_batch_size * t.grad_accum != t.global_batch:  # load_recipe derived them for another world
        world = torch.distributed.get_world_size()
        raise ConfigError(f"train.global_batch={t.global_batch} != data-parallel size {dp_size} x micro_batch_size="
                          f"{t.micro_batch_size} x grad_accum={t.grad_accum} in a world of {world} processes. Fix: "
                          "set nproc to the number of processes, or leave micro_batch_size and grad_accum at 0")
    return recipe, data


def resume_state(resume: str | None, pmodel, optimizer, data: TrainingData) -> int:
    """Load the checkpoint ``resume`` (a step directory, or a save_dir: its latest) into the model, the optimizer
    and the data position; the step to continue from (0 without one)."""
    if not resume:
        return 0
    from ..checkpoints.sharded import load_checkpoint  # DCP takes over a second to import: only for a run that loads

    p = Path(resume)
    meta = load_checkpoint(pmodel, optimizer, p if (p / "ultrascale.json").exists() else None, directory=p)
    first_step = int(meta["extra"].get("data_position", meta["step"]))
    data.resume(meta["extra"], first_step, resume)
    return first_step


def micro_batches(batch: dict, recipe: Recipe, pmodel) -> list[dict]:
    """A rank's batch as ``grad_accum`` chunks of ``micro_batch_size`` rows (every tensor entry sliced along its
    first dimension, the rows); the whole batch when the model runs the micro-batches itself (a pipeline's
    schedule: ``pmodel.tokens.microbatches_inside``) or there is no accumulation."""
    t = recipe.train
    if t.grad_accum <= 1 or pmodel.tokens.microbatches_inside > 1:
        return [batch]
    size = t.micro_batch_size
    return [{k: (v[i * size:(i + 1) * size] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            for i in range(t.grad_accum)]


def accumulate_step(pmodel, batch: dict, recipe: Recipe) -> float:
    """Forward and backward of one optimizer step over this rank's batch, micro-batch by micro-batch, with the
    gradients synchronised once, after the last; returns the step's loss: the mean over every valid token of the
    global batch (each micro-batch weighted by its share of the step's valid tokens: ``AccumulationWindow``)."""
    chunks = micro_batches(batch, recipe, pmodel)
    return AccumulationWindow.by_tokens(pmodel, chunks).run(
        pmodel, chunks, lambda chunk, weight: pmodel.train_step(chunk, loss_scale=weight))


def eval_batch(pmodel, batch: dict, recipe: Recipe) -> float:
    """Validation loss of a rank's batch in the training micro-batches (the memory the recipe sized): the mean over
    the valid tokens of the global batch."""
    chunks = micro_batches(batch, recipe, pmodel)
    return AccumulationWindow.by_tokens(pmodel, chunks).combine([pmodel.eval_step(chunk) for chunk in chunks])


def validation_loss(pmodel, data: TrainingData, recipe: Recipe) -> float | None:
    """The mean loss of the validation batches (None without validation data)."""
    rank, size = pmodel.data_parallel_rank, pmodel.data_parallel_size
    val = [eval_batch(pmodel, data.val_rows(i, rank, size), recipe) for i in range(data.eval_batches)]
    return sum(val) / len(val) if val else None


class Checkpoints:
    """The run's checkpoint cadence: every ``train.save_every`` steps, at the last step and at an agreed stop, into
    ``train.save_dir``, with the data position, the recipe and the pretrained directory the run started from; one
    in flight at a time when saved in the background (``train.async_save``)."""

    def __init__(self, recipe: Recipe, pmodel, optimizer, data: TrainingData, base_from: str | None):
        self.recipe, self.pmodel, self.optimizer, self.data, self.base_from = recipe, pmodel, optimizer, data, base_from
        self.saving = None  # a checkpoint being written in the background

    def due(self, steps_done: int, stopping: bool) -> bool:
        t = self.recipe.train
        return bool(t.save_dir) and ((t.save_every and steps_done % t.save_every == 0) or steps_done == t.steps
                                     or stopping)

    def poll(self) -> None:
        if self.saving is not None and self.saving.poll():
            self.saving = None

    def save(self, steps_done: int):
        """Write the checkpoint of ``steps_done`` steps (in the background with ``train.async_save``: its handle)."""
        from ..checkpoints.sharded import save_checkpoint  # DCP takes over a second to import: only when saving

        t = self.recipe.train
        if self.saving is not None:  # one checkpoint in flight at a time
            self.saving.wait()
        # the recipe (its peft section rebuilds a PEFT model's LoraConfig) and the pretrained directory the run
        # started from: in ultrascale.json, under "extra"
        extra = {**self.data.position(steps_done), "recipe": self.recipe.to_dict(), "init_from": self.base_from or ""}
        tokenizer = self.data.tokenizer
        written = save_checkpoint(self.pmodel, self.optimizer, t.save_dir, step=steps_done, extra=extra,
                                  keep_last_n=t.keep_last_n or None, asynchronous=t.async_save,
                                  assets={"tokenizer": tokenizer} if tokenizer is not None else None)
        self.saving = written if t.async_save else None
        return written

    def wait(self):
        """The checkpoint in flight written (its path), or None when none is."""
        written, self.saving = (self.saving.wait() if self.saving is not None else None), None
        return written


@dataclasses.dataclass
class LoopResult:
    losses: list
    seconds: float
    stopped: tuple | None = None  # (the signal, the steps done, the checkpoint saved) of an agreed stop


def train_loop(recipe: Recipe, pmodel, optimizer, data: TrainingData, checkpoints: Checkpoints, progress, stop,
               first_step: int = 0, profile_step: int = 0) -> LoopResult:
    """Optimizer steps ``first_step`` to ``train.steps``: the learning rate, this rank's rows, the accumulation
    window, clipping, the step, the report, the checkpoint when due. ``stop`` (``train.StopSignals``): after every
    step, every rank's vote; on a stop the step's checkpoint is committed and the loop ends. ``profile_step``: the
    step (1 = the first) whose collectives ``ParallelModel.profile_step`` records."""
    dp_rank, dp_size = pmodel.data_parallel_rank, pmodel.data_parallel_size
    losses, stopped, t = [], None, recipe.train
    stop.bar = progress.bar
    _timing_mark("loop_start")
    start = time.perf_counter()
    for step in range(first_step, t.steps):
        stop.step = step
        checkpoints.poll()
        lr = lr_at(step, recipe)
        for group in optimizer.param_groups:
            set_lr(group, lr)
        batch = data.train_rows(step, dp_rank, dp_size)
        recorder = contextlib.nullcontext()
        if step + 1 == profile_step:  # --profile-step: this step's collectives; rank 0 prints their table
            recorder = pmodel.profile_step(out=progress.bar.write if progress.bar is not None else None)
        with recorder:
            loss = accumulate_step(pmodel, batch, recipe)
            grad_norm = float(pmodel.clip_grad_norm_(t.max_grad_norm)) if t.max_grad_norm > 0 else None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if step == first_step:
            _timing_mark("first_step")
        progress.step_done(step, losses[-1], lr, grad_norm)
        stop_here = stop.agreed(progress.device)  # every rank's vote, so that all of them save and stop here
        if checkpoints.due(step + 1, stop_here):
            written = checkpoints.save(step + 1)
        if stop_here:  # the step's checkpoint (save_on_signal needs a save_dir) committed, then out
            stop.saving = True  # a failure from here on is the save's, not the signal's
            written = checkpoints.wait() or written
            stopped = (stop.signum, step + 1, str(written))
            stop.saving = False
            break
    stop.step = None
    checkpoints.wait()
    stop.uninstall()  # the loop is over: a SIGTERM from here on (validation) ends the worker at once
    return LoopResult(losses, time.perf_counter() - start, stopped)

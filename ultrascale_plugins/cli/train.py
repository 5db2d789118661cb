"""The training worker: one process per rank, started by ``ultrascale train``, torchrun or SLURM.

    torchrun --nnodes 2 --nproc_per_node 8 ... -m ultrascale_plugins.cli.train RECIPE.yaml --set tp=8
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # a worker: Ctrl-C ends it at once, not with KeyboardInterrupt's traceback (StopSignals)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from .. import _freeze_at_exit, _timing_mark, quiet_known_warnings  # noqa: E402
from ..interface.config import ConfigError  # noqa: E402
from ..distributed.launch import launched_world_size, report_error_and_wait  # noqa: E402
from ..data.recipe import Recipe, load_recipe  # noqa: E402


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def lr_at(step: int, recipe: Recipe) -> float:
    t = recipe.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def run(recipe: Recipe, metrics_path: str | None = None, resume: str | None = None,
        init_from: str | None = None, log_dir: str | None = None, stop: StopSignals | None = None,
        profile_step: int = 0) -> dict:
    """Train ``recipe``; returns the run's figures. ``stop`` (the worker's ``StopSignals``, installed with
    ``train.save_on_signal``): a SIGTERM on any rank ends the loop after the step every rank agrees on, with a
    checkpoint of it (``result["stopped"]``). ``profile_step``: the optimizer step (1 = the first) whose
    communication ``ParallelModel.profile_step`` records, rank 0 printing its table (0: none)."""
    from transformers import AutoModelForCausalLM

    quiet_known_warnings()
    from ..core import engine
    from ..distributed import launch
    from ..data.recipe_data import TrainingData

    _timing_mark("worker_imports")
    device = launch.init_distributed()
    _timing_mark("process_group")
    rank, world = dist.get_rank(), dist.get_world_size()
    # the seed of everything drawn: the initial weights (ModelInit, by torch.initial_seed()), a PEFT model's
    # adapters (drawn by the engine from this seed and each adapter's name, in any layout), the data order
    torch.manual_seed(recipe.train.seed)
    n_params = None  # the whole model's, not this rank's: counted before it is sharded
    trainable = None
    base_from = init_from  # where a PEFT model's frozen base is read from
    if not base_from and resume and recipe.peft is not None:  # adapter-only checkpoints: the run's --init-from
        from ..data.recipe import recorded_init_from

        base_from = recorded_init_from(resume) or None
    if init_from and recipe.peft is None:
        from ..core.engine import from_pretrained

        pmodel = from_pretrained(init_from, recipe.parallel, device=device)
    else:
        weights = None
        if base_from:  # the pretrained model's structure, its buffers computed; its weights are read per shard
            from ..checkpoints.pretrained import empty_model, read_config

            model = empty_model(read_config(base_from))
        else:
            with torch.device("meta"):  # no rank holds the whole model: parallelize initializes each rank's shards
                model = AutoModelForCausalLM.from_config(recipe.model_config())
        if recipe.peft is not None:  # the adapters on the meta device too: the engine draws them per shard
            from ..data.recipe import peft_model

            model = peft_model(model, recipe.peft)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_params = sum(p.numel() for p in model.parameters())
        if base_from:
            from ..checkpoints.pretrained import match_weights

            weights = match_weights(model, base_from)  # the adapters: drawn from train.seed
            if weights.unexpected and rank == 0:
                print(f"ultrascale: {base_from}: {len(weights.unexpected)} key(s) in the files are not used by the "
                      f"model: {', '.join(weights.unexpected[:8])}", flush=True)
        pmodel = engine.parallelize(model, recipe.parallel, device=device, init_weights=weights)
    model = pmodel.module
    _timing_mark("model_built")
    # torch's fused AdamW: one kernel per parameter group (every parameter is a DTensor under TP, so it composes)
    optimizer = pmodel.build_optimizer(torch.optim.AdamW, lr=recipe.train.lr,
                                       weight_decay=recipe.train.weight_decay, fused=True)
    data = TrainingData(recipe)  # recipe.init_from: the tokenizer's default directory
    if recipe.train.epochs:  # the steps of train.epochs passes over the dataset
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, steps=data.steps))
    dp_rank, dp_size = pmodel.data_parallel_rank, pmodel.data_parallel_size
    t = recipe.train
    if dp_size * t.micro_batch_size * t.grad_accum != t.global_batch:  # load_recipe derived them for another world
        raise ConfigError(f"train.global_batch={t.global_batch} != data-parallel size {dp_size} x micro_batch_size="
                          f"{t.micro_batch_size} x grad_accum={t.grad_accum} in a world of {world} processes. Fix: "
                          "set nproc to the number of processes, or leave micro_batch_size and grad_accum at 0")
    first_step = 0
    if resume:
        from ..checkpoints.sharded import load_checkpoint

        p = Path(resume)
        meta = load_checkpoint(pmodel, optimizer, p if (p / "ultrascale.json").exists() else None,
                               directory=p)
        first_step = int(meta["extra"].get("data_position", meta["step"]))
        data.resume(meta["extra"], first_step, resume)
    bar = None
    if rank == 0:
        from tqdm import tqdm

        if n_params is None:
            from ..interface.estimates import meta_model

            n_params = sum(p.numel() for p in meta_model(model.config).parameters())
        here = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in pmodel.parameters())
        held = "sharded over the ranks" if here < n_params else "a whole copy on every rank"
        source = f" from {base_from}" if base_from else ""
        adapters = ""
        if trainable is not None:
            adapters = (f", {recipe.peft.describe()}: {trainable / 1e6:.2f}M trainable "
                        f"({100 * trainable / n_params:.2f} %), the base frozen")
        print(f"ultrascale: {world} processes, layout {pmodel.dims.describe()}, "
              f"model {model.config.model_type}{source} {n_params / 1e6:.2f}M params ({held}){adapters}, "
              f"{recipe.train.steps} steps, batch {recipe.train.global_batch} = {dp_size} x micro-batch "
              f"{recipe.train.micro_batch_size} x {recipe.train.grad_accum} (data parallel x rows x accumulation)",
              flush=True)
        if first_step:  # before the bar: a line printed under it would break it
            print(f"ultrascale: resumed from {resume} at step {first_step}", flush=True)
        bar = tqdm(total=recipe.train.steps, initial=first_step, unit="step", dynamic_ncols=True, file=sys.stdout,
                   mininterval=0 if not sys.stdout.isatty() else 0.1)
    losses, tokens_per_step = [], recipe.train.global_batch * recipe.data.seq_len
    _timing_mark("loop_start")
    events = None  # TensorBoard event files in --log-dir (rank 0), made at the first logged step
    start = time.perf_counter()
    window_start, window_steps = start, 0
    saving = None  # a checkpoint being written in the background (train.async_save)
    stop = stop or StopSignals()
    stopped = None  # (the signal, the steps done, the checkpoint saved) once every rank agreed to stop
    stop.bar = bar
    for step in range(first_step, recipe.train.steps):
        stop.step = step
        if saving is not None and saving.poll():
            saving = None
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe)
        batch = data.train_rows(step, dp_rank, dp_size)
        recorder = contextlib.nullcontext()
        if step + 1 == profile_step:  # --profile-step: this step's collectives; rank 0 prints their table
            recorder = pmodel.profile_step(out=bar.write if bar is not None else None)
        with recorder:
            loss = accumulate_step(pmodel, batch, recipe)
            grad_norm = None
            if recipe.train.max_grad_norm > 0:
                grad_norm = float(pmodel.clip_grad_norm_(recipe.train.max_grad_norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if step == first_step:
            _timing_mark("first_step")
        window_steps += 1
        if (step + 1) % recipe.train.log_every == 0 or step + 1 == recipe.train.steps:
            peaks = [None] * world
            dist.all_gather_object(peaks, round(peak_memory_mb(device)))
            now = time.perf_counter()
            tok_s = window_steps * tokens_per_step / (now - window_start)
            window_start, window_steps = now, 0
            if log_dir and rank == 0:
                record = {"step": step + 1, "loss": losses[-1], "lr": lr_at(step, recipe), "grad_norm": grad_norm,
                          "tokens_per_s": tok_s, "peak_mb_per_rank": peaks}
                write_log_line(log_dir, record)
                events = events or EventLog(log_dir, bar)
                events.write(record)
            if bar is not None:
                idle = pmodel.pipeline_stats
                bubble = f" | pipeline idle {idle['idle_fraction']:.0%}" if idle else ""
                bar.set_postfix_str(f"loss {losses[-1]:.3f} | {tok_s:,.0f} tok/s{bubble} | peak MB/rank "
                                    + ",".join(str(p) for p in peaks), refresh=False)
                bar.update((step + 1) - bar.n)
        t = recipe.train
        stop_here = stop.agreed(device)  # every rank's vote, so that all of them save and stop at this step
        if t.save_dir and ((t.save_every and (step + 1) % t.save_every == 0) or step + 1 == t.steps or stop_here):
            from ..checkpoints.sharded import save_checkpoint

            if saving is not None:  # one checkpoint in flight at a time
                saving.wait()
            # the recipe (its peft section rebuilds a PEFT model's LoraConfig) and the pretrained directory the
            # run started from: in ultrascale.json, under "extra"
            extra = {**data.position(step + 1), "recipe": recipe.to_dict(), "init_from": base_from or ""}
            written = save_checkpoint(pmodel, optimizer, t.save_dir, step=step + 1, extra=extra,
                                      keep_last_n=t.keep_last_n or None, asynchronous=t.async_save,
                                      assets={"tokenizer": data.tokenizer} if data.tokenizer is not None else None)
            saving = written if t.async_save else None
        if stop_here:  # the step's checkpoint (save_on_signal needs a save_dir) committed, then out
            stop.saving = True  # a failure from here on is the save's, not the signal's
            if saving is not None:
                written, saving = saving.wait(), None
            stopped = (stop.signum, step + 1, str(written))
            stop.saving = False
            break
    stop.step = None
    if saving is not None:
        saving.wait()
    stop.uninstall()  # the loop is over: a SIGTERM from here on (validation) ends the worker at once
    elapsed = time.perf_counter() - start
    _timing_mark("loop_done")
    val = [] if stopped else [eval_batch(pmodel, data.val_rows(i, dp_rank, dp_size), recipe)
                              for i in range(data.eval_batches)]
    result = {"losses": losses, "val_loss": sum(val) / len(val) if val else None, "seconds": elapsed,
              "tokens_per_s": tokens_per_step * len(losses) / elapsed, "world_size": world}
    if stopped:
        result["stopped"] = {"signal": stopped[0], "step": stopped[1], "checkpoint": stopped[2]}
    if events is not None:
        events.close()
    if bar is not None and stopped:
        bar.close()
    elif bar is not None and losses:
        bar.close()
        val_text = f"validation loss {result['val_loss']:.3f}" if val else "no validation data"
        print(f"ultrascale: {loss_summary(losses)}, {val_text}, {result['tokens_per_s']:,.0f} tok/s, "
              f"{elapsed:.1f}s", flush=True)
        if metrics_path:
            with open(metrics_path, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()
    _timing_mark("run_done")
    return result


def loss_summary(losses: list[float], window: int = 5) -> str:
    """The run's loss in the final line: the mean of the first and of the last ``window`` steps, each window at
    most half the run so the two never share a step (a 2-step run compares its first step with its last; one step
    is just its loss)."""
    if len(losses) == 1:
        return f"loss {losses[0]:.3f} (one step)"
    n = min(window, len(losses) // 2)
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    said = "first/last step" if n == 1 else f"mean of first/last {n} steps"
    return f"loss {first:.3f} -> {last:.3f} ({said} of {len(losses)})"


class StopSignals:
    """A worker's SIGTERM with ``train.save_on_signal`` (from ``ultrascale train`` through torchrun, torchrun
    itself, SLURM's scancel): noted by the handler (``install``), and asked for after every step by ``agreed``,
    which takes the largest vote of every rank (one all-reduce of one integer), so that all ranks stop after the
    same step and save it, and none waits forever for the others in the save.

    Every other stop keeps the signal's default action, which ends the process at once wherever it is (a
    collective that blocks in C++ included, where a Python handler would wait for it to return) and prints
    nothing: SIGTERM without the setting, SIGINT (set back from Python's ``KeyboardInterrupt`` as soon as the
    worker's module starts), SIGHUP."""

    def __init__(self):
        self.signum = 0  # the SIGTERM noted; 0: none
        self.installed = False
        self.saving = False  # inside the save of a stop: a failure there is the save's own
        self.step = None  # the step being trained (0-based), for the line that says where the run stopped
        self.bar = None  # rank 0's progress bar, closed before the line

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._note)
        self.installed = True

    def uninstall(self) -> None:
        """The loop is over (its last checkpoint written): a SIGTERM from now on ends the worker at once."""
        if self.installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.installed = False

    def _note(self, signum: int, frame) -> None:
        self.signum = signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank has been asked to stop (collective: with the handler installed, every
        rank calls it after every step; without, there is nothing to agree on and nothing is exchanged)."""
        if not self.installed:
            return False
        vote = torch.tensor([self.signum], dtype=torch.int32, device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        agreed = int(vote)  # the same on every rank: this rank's own SIGTERM, noted after its vote, waits a step
        self.signum = self.signum or agreed  # another rank's, when this one's is still on its way
        return bool(agreed)

    def explains(self, exc: BaseException) -> bool:
        """Whether ``exc`` comes from the stop rather than a fault: any error once a SIGTERM was noted (a peer
        that ended at once, on a SIGINT, breaks the collective this rank waits in), but a failure of the save."""
        return bool(self.signum and not self.saving)

    def end(self, stopped: dict | None = None) -> None:
        """Say once how the workers stopped (``supervisor.say_stopped``), then end this process by the signal."""
        from .supervisor import end_by_signal, say_stopped

        name = signal.Signals(self.signum).name
        if stopped:
            where = (f"stopped after step {stopped['step']} and saved {stopped['checkpoint']} (continue with "
                     f"--resume {os.path.dirname(stopped['checkpoint'])})")
        elif self.step is not None:
            where = f"stopped during step {self.step + 1}, without saving it (another process ended first)"
        else:
            where = "stopped outside the training steps, without a checkpoint of its own"
        if self.bar is not None:
            self.bar.close()
        say_stopped(f"ultrascale: {name}: {where}")
        end_by_signal(self.signum)


def micro_batches(batch: dict, recipe: Recipe) -> list[dict]:
    """A rank's batch as ``grad_accum`` chunks of ``micro_batch_size`` rows (every tensor entry sliced along its
    first dimension, the rows); the whole batch when a pipeline runs the micro-batches itself (pp > 1) or there is
    no accumulation."""
    t = recipe.train
    if t.grad_accum <= 1 or getattr(recipe.parallel, "pp", 1) > 1:
        return [batch]
    size = t.micro_batch_size
    return [{k: (v[i * size:(i + 1) * size] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            for i in range(t.grad_accum)]


def accumulate_step(pmodel, batch: dict, recipe: Recipe) -> float:
    """Forward and backward of one optimizer step over this rank's batch, micro-batch by micro-batch, with the
    gradients synchronised once, after the last; returns the step's loss: the mean over every valid token of the
    global batch.

    Each micro-batch's own loss is the mean over its valid tokens on all data-parallel ranks; weighting it by its
    share of the step's valid tokens (``loss_scale``) makes the sum exactly the global-batch mean, in value and
    gradient, however unevenly padding and prompt tokens (``-100``) fall across micro-batches."""
    chunks = micro_batches(batch, recipe)
    shares = pmodel.token_shares(chunks)
    losses = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        with (contextlib.nullcontext() if last else pmodel.no_sync()):
            losses.append(float(pmodel.train_step(chunk, loss_scale=shares[i])))
    return sum(w * v for w, v in zip(shares, losses))


def eval_batch(pmodel, batch: dict, recipe: Recipe) -> float:
    """Validation loss of a rank's batch in the training micro-batches (the memory the recipe sized): the mean over
    the valid tokens of the global batch."""
    chunks = micro_batches(batch, recipe)
    shares = pmodel.token_shares(chunks)
    return sum(w * float(pmodel.eval_step(chunk)) for w, chunk in zip(shares, chunks))


def write_log_line(log_dir: str, record: dict) -> None:
    """One JSON line per logged step in ``LOG_DIR/metrics.jsonl`` (rank 0), appended and flushed as it comes, so a
    run can be watched (``tail -f``) or read back while it trains."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(log_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


class EventLog:
    """TensorBoard event files in ``LOG_DIR`` beside ``metrics.jsonl``: the same values per logged step, with peak
    memory as one scalar per rank (``memory/peak_mb_rank{r}``). Without the ``tensorboard`` package (the
    ``ultrascale-plugins[tensorboard]`` extra) only the JSON lines are written, and that is said once."""

    def __init__(self, log_dir: str, bar=None):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package
            note = ("ultrascale: --log-dir writes metrics.jsonl only; pip install ultrascale-plugins[tensorboard] "
                    "adds TensorBoard event files")
            (bar.write if bar is not None else print)(note)
            return
        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["step"]
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            if record.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", record[key], step)
        for r, mb in enumerate(record.get("peak_mb_per_rank") or []):
            self.writer.add_scalar(f"memory/peak_mb_rank{r}", mb, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ultrascale_plugins.cli.train")
    parser.add_argument("recipe", nargs="?")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--metrics", default=os.environ.get("ULTRASCALE_METRICS"))
    parser.add_argument("--resume")
    parser.add_argument("--init-from")
    parser.add_argument("--log-dir", default=os.environ.get("ULTRASCALE_LOG_DIR"))
    parser.add_argument("--profile-step", type=int, default=0)
    args = parser.parse_args(argv)
    _timing_mark("worker_main")
    _freeze_at_exit()
    stop = StopSignals()
    try:
        recipe = load_recipe(args.recipe, args.overrides, world_size=launched_world_size(), init_from=args.init_from,
                             resume_from=args.resume)
        _timing_mark("worker_recipe")
        if recipe.train.save_on_signal:
            stop.install()
        result = run(recipe, args.metrics, args.resume, args.init_from, args.log_dir, stop=stop,
                     profile_step=args.profile_step)
        if stop.signum:  # the loop's agreed stop, or a SIGTERM that came after its last vote
            stop.end(result.get("stopped"))
    except ConfigError as exc:  # rank 0 says it; the others wait for it (a fast rank's exit would end the job first)
        report_error_and_wait(exc)
        return 2
    except BaseException as exc:
        if stop.explains(exc):
            stop.end()
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

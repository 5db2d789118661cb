"""What a training run shows and writes: rank 0's opening line and progress bar, each logged step's figures (the
bar's postfix, ``LOG_DIR/metrics.jsonl`` and TensorBoard event files), and the closing line."""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..interface.extras import install_command


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


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


def write_log_line(log_dir: str, record: dict) -> None:
    """One JSON line per logged step in ``LOG_DIR/metrics.jsonl`` (rank 0), appended and flushed as it comes, so a
    run can be watched (``tail -f``) or read back while it trains."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(log_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def logged_step(line: str) -> int | None:
    """The step of one line of ``metrics.jsonl`` (None for a line that is not one of its records)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def keep_log_lines_through(log_dir: str, last_step: int) -> None:
    """Before a resumed run's first line: ``metrics.jsonl`` without the records after the resumed step
    ``last_step`` (the interrupted run's, which the resumed run logs again), so the file holds one curve. Written
    aside and moved over the old file, so a failure here leaves it as it was; lines that are not records are kept."""
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if (logged_step(line) or 0) <= last_step]
    if len(kept) == len(lines):
        return
    aside = path.with_name(path.name + ".tmp")
    with open(aside, "w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(aside, path)


class EventLog:
    """TensorBoard event files in ``LOG_DIR`` beside ``metrics.jsonl``: the same values per logged step, with peak
    memory as one scalar per rank (``memory/peak_mb_rank{r}``). Without the ``tensorboard`` package (the
    ``tensorboard`` extra) only the JSON lines are written, and that is said once.
    ``purge_step`` (a resumed run's first step, 1-based): TensorBoard hides the earlier files' events from that step
    on, the interrupted run's steps that the resumed one logs again."""

    def __init__(self, log_dir: str, bar=None, purge_step: int | None = None):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter  # an optional extra: asked for only with --log-dir
        except ImportError:  # torch's writer needs the tensorboard package
            note = (f"ultrascale: --log-dir writes metrics.jsonl only; {install_command('tensorboard')} "
                    "adds TensorBoard event files")
            (bar.write if bar is not None else print)(note)
            return
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

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


class Progress:
    """A run's reporting, on every rank (rank 0 alone prints and writes; every rank takes part in the peak-memory
    exchange of a logged step). ``opening`` says the layout, the model and the batch, then starts the bar;
    ``step_done`` after each optimizer step; ``closing`` the final line."""

    def __init__(self, recipe, built, device: torch.device, log_dir: str | None = None, resumed_at: int = 0):
        self.recipe, self.built, self.device, self.log_dir = recipe, built, device, log_dir
        self.resumed_at = resumed_at  # the checkpoint's step: --log-dir's records after it are superseded
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tokens_per_step = recipe.train.global_batch * recipe.data.seq_len
        self.bar = None
        self.events = None  # TensorBoard event files in --log-dir (rank 0), made at the first logged step
        self.window_start = self.window_steps = None

    def say(self, text: str) -> None:
        """A line for the user under the bar (rank 0) or on its own."""
        (self.bar.write if self.bar is not None else print)(text)

    def opening(self, first_step: int, resume: str | None) -> None:
        if self.rank == 0:
            recipe, built, pmodel = self.recipe, self.built, self.built.pmodel
            n_params = built.whole_model_params()
            here = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in pmodel.parameters())
            held = "sharded over the ranks" if here < n_params else "a whole copy on every rank"
            source = f" from {built.base_from}" if built.base_from else ""
            adapters = ""
            if built.trainable is not None:
                adapters = (f", {recipe.describe_sections()}: {built.trainable / 1e6:.2f}M trainable "
                            f"({100 * built.trainable / n_params:.2f} %), the base frozen")
            t = recipe.train
            print(f"ultrascale: {self.world} processes, layout {pmodel.dims.describe()}, "
                  f"model {pmodel.module.config.model_type}{source} {n_params / 1e6:.2f}M params ({held}){adapters}, "
                  f"{t.steps} steps, batch {t.global_batch} = {pmodel.data_parallel_size} x micro-batch "
                  f"{t.micro_batch_size} x {t.grad_accum} (data parallel x rows x accumulation)", flush=True)
            if first_step:  # before the bar: a line printed under it would break it
                print(f"ultrascale: resumed from {resume} at step {first_step}", flush=True)
            self.bar = tqdm(total=t.steps, initial=first_step, unit="step", dynamic_ncols=True, file=sys.stdout,
                            mininterval=0 if not sys.stdout.isatty() else 0.1)
        self.window_start, self.window_steps = time.perf_counter(), 0

    def step_done(self, step: int, loss: float, lr: float, grad_norm: float | None) -> None:
        """After optimizer step ``step`` (0-based): at a logged step, every rank's peak memory (a collective), the
        tokens per second since the last one, the JSON line and event files, the bar."""
        self.window_steps += 1
        t = self.recipe.train
        if not ((step + 1) % t.log_every == 0 or step + 1 == t.steps):
            return
        peaks = [None] * self.world
        dist.all_gather_object(peaks, round(peak_memory_mb(self.device)))
        now = time.perf_counter()
        tok_s = self.window_steps * self.tokens_per_step / (now - self.window_start)
        self.window_start, self.window_steps = now, 0
        if self.log_dir and self.rank == 0:
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tok_s,
                      "peak_mb_per_rank": peaks}
            if self.events is None:  # this run's first line
                self.events = self.open_logs()
            write_log_line(self.log_dir, record)
            self.events.write(record)
        if self.bar is not None:
            idle = self.built.pmodel.pipeline_stats
            bubble = f" | pipeline idle {idle['idle_fraction']:.0%}" if idle else ""
            self.bar.set_postfix_str(f"loss {loss:.3f} | {tok_s:,.0f} tok/s{bubble} | peak MB/rank "
                                     + ",".join(str(p) for p in peaks), refresh=False)
            self.bar.update((step + 1) - self.bar.n)

    def open_logs(self) -> EventLog:
        """--log-dir at this run's first logged step: after a resume, what the interrupted run logged after the
        checkpoint is superseded (metrics.jsonl rewritten without it, TensorBoard told to hide it), so that each
        step is plotted once, with the values of the run that continued."""
        if not self.resumed_at:
            return EventLog(self.log_dir, self.bar)
        keep_log_lines_through(self.log_dir, self.resumed_at)
        return EventLog(self.log_dir, self.bar, purge_step=self.resumed_at + 1)

    def closing(self, result: dict, metrics_path: str | None = None) -> None:
        """The closing line and the metrics file (rank 0); nothing but the bar's end after a stop by signal."""
        if self.events is not None:
            self.events.close()
        if self.bar is None or not (result.get("stopped") or result["losses"]):
            return
        self.bar.close()
        if result.get("stopped"):
            return
        val_text = f"validation loss {result['val_loss']:.3f}" if result["val_loss"] is not None else \
            "no validation data"
        print(f"ultrascale: {loss_summary(result['losses'])}, {val_text}, {result['tokens_per_s']:,.0f} tok/s, "
              f"{result['seconds']:.1f}s", flush=True)
        if metrics_path:
            with open(metrics_path, "w") as f:
                json.dump(result, f)

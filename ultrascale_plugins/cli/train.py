"""The training worker: one process per rank, started by ``ultrascale train``, torchrun or SLURM.

    torchrun --nnodes 2 --nproc_per_node 8 ... -m ultrascale_plugins.cli.train RECIPE.yaml --set tp=8
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

if __name__ == "__main__":  # a worker: Ctrl-C ends it at once, not with KeyboardInterrupt's traceback (StopSignals)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from .. import _freeze_at_exit, _timing_mark, quiet_known_warnings  # noqa: E402
from ..data.recipe import Recipe, load_recipe  # noqa: E402
from ..distributed.launch import init_distributed, launched_world_size, report_error_and_wait  # noqa: E402
from ..interface.config import ConfigError  # noqa: E402
from .loop import Checkpoints, make_optimizer, resume_state, train_loop, training_data, validation_loss  # noqa: E402
from .model_build import build_model  # noqa: E402
from .progress import Progress  # noqa: E402


def run(recipe: Recipe, metrics_path: str | None = None, resume: str | None = None,
        init_from: str | None = None, log_dir: str | None = None, stop: StopSignals | None = None,
        profile_step: int = 0) -> dict:
    """Train ``recipe``; returns the run's figures. ``stop`` (the worker's ``StopSignals``, installed with
    ``train.save_on_signal``): a SIGTERM on any rank ends the loop after the step every rank agrees on, with a
    checkpoint of it (``result["stopped"]``). ``profile_step``: the optimizer step (1 = the first) whose
    communication ``ParallelModel.profile_step`` records, rank 0 printing its table (0: none)."""
    quiet_known_warnings()
    _timing_mark("worker_imports")
    device = init_distributed()
    _timing_mark("process_group")
    # the seed of everything drawn: the initial weights (ModelInit, by torch.initial_seed()), a PEFT model's
    # adapters (drawn by the engine from this seed and each adapter's name, in any layout), the data order
    torch.manual_seed(recipe.train.seed)
    built = build_model(recipe, device, init_from=init_from, resume=resume)
    pmodel = built.pmodel
    _timing_mark("model_built")
    optimizer = make_optimizer(pmodel, recipe)
    recipe, data = training_data(recipe, pmodel)
    first_step = resume_state(resume, pmodel, optimizer, data)
    progress = Progress(recipe, built, device, log_dir, resumed_at=first_step)
    progress.opening(first_step, resume)
    loop = train_loop(recipe, pmodel, optimizer, data, Checkpoints(recipe, pmodel, optimizer, data, built.base_from),
                      progress, stop or StopSignals(), first_step, profile_step)
    _timing_mark("loop_done")
    result = {"losses": loop.losses, "val_loss": None if loop.stopped else validation_loss(pmodel, data, recipe),
              "seconds": loop.seconds, "tokens_per_s": progress.tokens_per_step * len(loop.losses) / loop.seconds,
              "world_size": dist.get_world_size()}
    if loop.stopped:
        result["stopped"] = dict(zip(("signal", "step", "checkpoint"), loop.stopped))
    progress.closing(result, metrics_path)
    dist.destroy_process_group()
    _timing_mark("run_done")
    return result


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
        from ..distributed.supervisor import end_by_signal, say_stopped

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

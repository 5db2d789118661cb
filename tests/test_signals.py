"""Stopping ``ultrascale train`` on a signal (issue 32): SIGTERM (``kill``, a scheduler's scancel) and SIGINT (Ctrl-C)
end every process the command started (the command, torchrun, the workers) within a bound, without a traceback,
with one line saying what happened, and the command ends by that signal (a shell's status 128 + its number). With
``train.save_on_signal`` a SIGTERM first finishes the step every rank agrees on and saves it, and ``--resume``
continues from there."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ultrascale_plugins.cli import main as cli
from ultrascale_plugins.distributed import supervisor
from ultrascale_plugins.interface.config import ConfigError
from ultrascale_plugins.data.recipe import load_recipe

TINY = ["--set", "pp=1", "--set", "tp=1", "--set", "sequence_parallel=false", "--set", "train.steps=100000",
        "--set", "train.log_every=1"]  # the embedded default's tiny Llama, training far longer than the test waits


def start(tmp_path, nproc: int, *args: str):
    """``ultrascale train`` as a user starts it, in a session of its own (so that a signal to its process group is
    what a terminal's Ctrl-C sends to the foreground job); its output in a file."""
    out = open(tmp_path / f"out-{time.monotonic_ns()}.txt", "w+")
    cmd = [sys.executable, "-m", "ultrascale_plugins.cli.main", "train", "--nproc", str(nproc), "--set",
           f"dp_shard={nproc}", *TINY, *args]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), out


def logged_steps(log_dir) -> list[int]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_training(proc, out, log_dir, steps: int = 2, timeout: float = 240) -> list:
    """Wait until ``steps`` steps are logged; return every process under the command (and itself), found now."""
    deadline = time.monotonic() + timeout
    while len(logged_steps(log_dir)) < steps:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out.seek(0)
            pytest.fail(f"no training (exit {proc.returncode}):\n{out.read()[-4000:]}")
        time.sleep(0.2)
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def stop_and_check(proc, out, tree: list, signum: int, group: bool, bound: float) -> tuple[str, float]:
    """Send ``signum`` (to the command, or to its process group as Ctrl-C does) and check that every process of
    ``tree`` is gone within ``bound`` seconds, that the command ended by the signal, and that nothing printed a
    traceback; returns the output and the seconds it took."""
    start_t = time.monotonic()
    (os.killpg if group else os.kill)(proc.pid, signum)
    try:
        proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        pass
    _, alive = psutil.wait_procs(tree, timeout=max(0.1, bound - (time.monotonic() - start_t)))
    took = time.monotonic() - start_t
    for p in alive:  # never leave a process behind, whatever the outcome
        p.kill()
    out.seek(0)
    text = out.read()
    assert not alive, f"still running {took:.1f}s after {signal.Signals(signum).name}: " \
                      f"{[' '.join(p.cmdline()[:6]) for p in alive]}\n{text[-3000:]}"
    assert proc.returncode == -signum, (proc.returncode, text[-3000:])
    assert "Traceback" not in text, text[-6000:]
    return text, took


def stop_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith(("ultrascale: SIG",))]


@pytest.mark.slow
def test_sigterm_stops_the_command_torchrun_and_the_workers(tmp_path):
    """SIGTERM to the command's pid (``kill PID``) used to leave torchrun and the workers training on, re-parented
    to init. Without train.save_on_signal they all stop at once."""
    proc, out = start(tmp_path, 2, "--log-dir", str(tmp_path / "logs"))
    tree = wait_for_training(proc, out, tmp_path / "logs")
    assert len(tree) == 4  # the command, torchrun, two workers
    text, took = stop_and_check(proc, out, tree, signal.SIGTERM, group=False, bound=30)
    assert stop_lines(text) == ["ultrascale: SIGTERM: stopped the workers at once, without saving "
                                "(train.save_on_signal is off)"], text[-3000:]
    assert took < 15, took


@pytest.mark.slow
def test_sigterm_with_save_on_signal_saves_the_agreed_step_and_resume_continues(tmp_path):
    """train.save_on_signal: the SIGTERM ends the loop after the same step on both ranks, which is saved (an
    asynchronous checkpoint in flight is waited for) with its data position; ``--resume`` continues from it, here on
    one process (the single-process path), stopped by Ctrl-C: SIGINT to the process group stops at once."""
    ckpt = tmp_path / "ckpt"
    save = ["--set", "train.save_on_signal=true", "--set", f"train.save_dir={ckpt}", "--set", "train.async_save=true",
            "--set", "train.save_every=2"]
    proc, out = start(tmp_path, 2, *save, "--log-dir", str(tmp_path / "logs"))
    tree = wait_for_training(proc, out, tmp_path / "logs", steps=3)
    text, _ = stop_and_check(proc, out, tree, signal.SIGTERM, group=False, bound=60)
    done = logged_steps(tmp_path / "logs")[-1]  # every step rank 0 trained
    saved = ckpt / f"step-{done:08d}"
    assert stop_lines(text) == [f"ultrascale: SIGTERM: stopped after step {done} and saved {saved} (continue with "
                                f"--resume {ckpt})"], text[-3000:]
    meta = json.loads((saved / "ultrascale.json").read_text())  # committed: both ranks reached the save
    assert meta["step"] == done and meta["extra"]["data_position"] == done
    assert max(int(p.name[5:]) for p in ckpt.glob("step-*")) == done

    proc, out = start(tmp_path, 1, *save, "--resume", str(ckpt), "--log-dir", str(tmp_path / "resumed"))
    tree = wait_for_training(proc, out, tmp_path / "resumed", steps=2)
    text, took = stop_and_check(proc, out, tree, signal.SIGINT, group=True, bound=30)
    assert f"resumed from {saved} at step {done}" in text
    assert logged_steps(tmp_path / "resumed")[:2] == [done + 1, done + 2]
    assert stop_lines(text) == ["ultrascale: SIGINT: stopped the workers at once, without saving (only SIGTERM "
                                "saves first, with train.save_on_signal)"], text[-3000:]
    assert took < 15, took


def test_the_signal_settings_are_checked_before_launch(monkeypatch, capsys):
    """train.save_on_signal needs a save_dir; the grace is at least a second; a torchrun without --shutdown-timeout
    only honours its own 30 s. ``ultrascale train`` in this process leaves its signal handlers as it found them."""
    with pytest.raises(ConfigError, match=r"^train.save_on_signal=true needs train.save_dir .* Fix: set"):
        load_recipe(None, ["train.save_on_signal=true"])
    with pytest.raises(ConfigError, match=r"^train.signal_grace_s=0: must be at least 1 second\. Fix:"):
        load_recipe(None, ["train.signal_grace_s=0"])
    assert cli.shutdown_timeout(45) == ["--shutdown-timeout", "45"]  # torch 2.13's torchrun has the flag

    class OldParser:  # a torchrun from before --shutdown-timeout
        def parse_args(self, args):
            import argparse

            return argparse.Namespace(training_script="-")

    import torch.distributed.run

    monkeypatch.setattr(torch.distributed.run, "get_args_parser", OldParser)
    assert cli.shutdown_timeout(30) == []
    with pytest.raises(ConfigError, match=r"^train.signal_grace_s=45: .* has no --shutdown-timeout .* Fix: set "
                                          r"train.signal_grace_s: 30"):
        cli.shutdown_timeout(45)
    before = {s: signal.getsignal(s) for s in supervisor.STOP_SIGNALS}
    assert cli.main(["train", "--set", "train.stepz=1"]) == 2
    assert {s: signal.getsignal(s) for s in supervisor.STOP_SIGNALS} == before
    assert "did you mean 'steps'" in capsys.readouterr().err


def test_every_rank_takes_the_vote_not_its_own_late_signal(monkeypatch):
    """``StopSignals.agreed``: the all-reduced vote decides on every rank alike. A peer's SIGTERM stops this rank
    too; this rank's own SIGTERM noted while the vote was in flight is kept for the next step's vote, not acted on
    alone (that rank would save while the others train on, and wait for them for ever)."""
    import torch

    from ultrascale_plugins.cli import train

    stop = train.StopSignals()
    stop.installed = True  # as install() leaves it, without touching this process's handlers

    def peers_vote(tensor, op):  # another rank has had a SIGTERM
        tensor.fill_(int(signal.SIGTERM))

    monkeypatch.setattr(train.dist, "all_reduce", peers_vote)
    assert stop.agreed(torch.device("cpu")) is True and stop.signum == signal.SIGTERM

    stop = train.StopSignals()
    stop.installed = True

    def own_signal_meanwhile(tensor, op):  # nobody had voted; this rank's handler runs before the vote returns
        stop._note(signal.SIGTERM, None)

    monkeypatch.setattr(train.dist, "all_reduce", own_signal_meanwhile)
    assert stop.agreed(torch.device("cpu")) is False
    monkeypatch.setattr(train.dist, "all_reduce", lambda tensor, op: None)  # its vote goes out with the next step
    assert stop.agreed(torch.device("cpu")) is True
    stop.installed = False
    assert stop.agreed(torch.device("cpu")) is False  # without save_on_signal nothing is exchanged


def test_what_a_launcher_prints_after_a_workers_error_is_dropped(tmp_path, monkeypatch):
    """A worker that refuses writes the error file; the launcher's report of the failed workers that follows (torchrun's
    ChildFailedError) is dropped, so the command's one line is all that is said; what came before passes through."""
    import io

    error, seen = tmp_path / "error", tmp_path / "seen"

    class CommandStderr(io.BytesIO):
        """The command's standard error; it marks that the progress line reached it, so that the worker writes its
        error file only then (the order a real launch has; without it a slow machine's reader thread could wake
        after the file exists and rightly drop the line)."""

        def write(self, data):
            n = super().write(data)
            seen.touch()
            return n

    script = ("import os, sys, time; sys.stderr.write('progress before\\n'); sys.stderr.flush(); "
              f"end = time.time() + 30\nwhile not os.path.exists({str(seen)!r}) and time.time() < end: time.sleep(0.01)\n"
              f"open({str(error)!r}, 'w').write('tp=3: bad'); time.sleep(0.3); "
              "sys.stderr.write('Traceback: ChildFailedError\\n'); sys.exit(1)")
    said = CommandStderr()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(said))
    watcher = supervisor.Supervisor()
    try:
        code = watcher.run([sys.executable, "-c", script], dict(os.environ), 30, own_session=True,
                           error_file=str(error))
    finally:
        watcher.restore()
    err = said.getvalue().decode()
    assert code == 1 and "progress before" in err and "ChildFailedError" not in err, err

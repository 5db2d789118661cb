"""How the package's launchers run the processes they start and stop them on a signal: ``ultrascale train``
(torchrun, or the one worker) and ``ultrascale accelerate-launch`` (Accelerate's launcher).

SIGTERM (kill, a scheduler), SIGINT (Ctrl-C) and SIGHUP (the terminal closed) are passed on once to the process
started, which passes them to the workers; whatever is still running a grace period later is killed; the command
then ends by the signal it got, without a traceback. A configuration error a worker finds is said once: the
workers write it to ``ULTRASCALE_ERROR_FILE`` (``launch.report_error``), and what the launcher prints after it (its
report of the failed workers) is dropped, so the command's one line replaces it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_FILE_ENV = "ULTRASCALE_STOP_FILE"
TORCHRUN_DEFAULT_GRACE_S = 30  # torchrun's wait between the signal it forwards and its SIGKILL, when not set
KILL_MARGIN_S = 10  # after the grace: for torchrun's own SIGKILL of the workers and its exit
# torchrun (torch.distributed.run), ended by the signal it stopped on instead of with its SignalException's traceback
TORCHRUN = ("import sys; from ultrascale_plugins.distributed.supervisor import torchrun_main; "
            "sys.exit(torchrun_main(sys.argv[1:]))")


def end_by_signal(signum: int) -> None:
    """End this process by ``signum``, as one that does not handle it ends: no traceback, no exit handlers, and
    its parent sees the signal (a shell's status 128 + its number: 143 for SIGTERM, 130 for SIGINT, 129 for
    SIGHUP; a shell script stops on a Ctrl-C that ended its command this way, and continues after one that
    exited normally)."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    signal.raise_signal(signum)
    os._exit(128 + signum)  # not reached: the signal's default action ended the process


def say_stopped(line: str) -> None:
    """A worker's one line on how it stopped: into the file ``ultrascale train`` named (the first of its local
    workers; the command prints it once they are gone, and says so itself when they had to be killed), else by
    global rank 0 on stdout."""
    from .launch import say_once

    say_once(line, STOP_FILE_ENV, line, sys.stdout)


def torchrun_main(argv: list[str]) -> int:
    """torchrun for ``ultrascale train``: on a stop signal torchrun passes it to the workers, waits for them up to
    its ``--shutdown-timeout`` (then kills them) and raises ``SignalException``, which ends it here by that
    signal, without a traceback. A worker's failure is torchrun's to report, as before."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # until torchrun's handlers: a SIGINT ends it, without a traceback
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    # its notes on passing the signal on and killing (warnings of loggers that LOGLEVEL does not reach)
    logging.getLogger("torch.distributed.elastic").setLevel(os.environ.get("LOGLEVEL", "WARNING"))
    try:
        main(argv)
    except SignalException as exc:
        end_by_signal(exc.sigval)
    return 0


class Supervisor:
    """``ultrascale train``'s SIGTERM, SIGINT and SIGHUP. Before anything starts the command just ends. Once it has
    started its process (torchrun, or the one worker), the first signal is passed to it: torchrun passes it on to
    the workers, which stop (at once, or after saving the step with ``train.save_on_signal``), kills those still
    running after ``--shutdown-timeout`` (``train.signal_grace_s``) and exits. Whatever is left a margin after
    that is killed here. Later signals add nothing. The command then ends by the first signal (``end_by_signal``)."""

    def __init__(self):
        self.signum = 0
        self.child: subprocess.Popen | None = None
        self.launching = False
        self.grace = TORCHRUN_DEFAULT_GRACE_S
        self.forwarded_at: float | None = None
        self.killed = False
        self.save_on_signal = False  # the recipe's: what a stop without the workers' own line was
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # (only the main thread may set handlers)
            self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def restore(self) -> None:
        """The handlers there were before (``cli.main`` called in a process that goes on, e.g. a test's)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        if self.signum:
            return
        self.signum = signum
        if self.child is None and not self.launching:
            line = f"ultrascale: {signal.Signals(signum).name}: stopped before any worker started\n"
            os.write(sys.stderr.fileno(), line.encode())  # (not print: the main thread may be inside one)
            end_by_signal(signum)
        self._forward()

    def _forward(self) -> None:
        if self.child is None or self.forwarded_at is not None:
            return
        self.forwarded_at = time.monotonic()
        try:
            self.child.send_signal(self.signum)
        except ProcessLookupError:
            pass

    def run(self, cmd: list[str], env: dict, grace: int, own_session: bool, error_file: str | None = None) -> int:
        """``cmd``'s exit status, with a signal passed on and bounded (see the class). ``error_file``: where the
        workers write a configuration error; the process's standard error passes through as it comes (progress
        bars included) until the file exists, and is dropped after it (the job ending because of that error,
        which the caller's one line replaces)."""
        self.grace = grace
        self.launching = True  # a signal now is passed on as soon as the process exists
        self.child = subprocess.Popen(cmd, env=env, start_new_session=own_session,
                                      stderr=subprocess.PIPE if error_file else None)
        self.launching = False
        reader = None
        if error_file:
            reader = threading.Thread(target=_copy_until, args=(self.child.stderr, error_file), daemon=True)
            reader.start()
        if self.signum:
            self._forward()
        while True:
            try:
                code = self.child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if self.forwarded_at is not None and time.monotonic() > self.forwarded_at + grace + KILL_MARGIN_S:
                    self.killed = True
                    kill_process_tree(self.child.pid)
        if reader is not None:
            reader.join(timeout=5)  # a worker that outlived the launcher may hold the pipe open
        return code

    def line(self, stop_file: str, quiet: bool = False) -> str | None:
        """What to say once the workers are gone: that they were killed, else their line (``stop_file``), else that
        they stopped at once without saving; with ``quiet`` only the first (None otherwise)."""
        name = signal.Signals(self.signum).name
        waited = time.monotonic() - (self.forwarded_at or time.monotonic())
        if self.killed or waited >= self.grace:
            return (f"\nultrascale: {name}: the workers had not stopped {self.grace} s after it and were killed "
                    "(train.signal_grace_s: raise it to give them time to finish a step and save)")
        if quiet:
            return None
        if os.path.isfile(stop_file):
            return open(stop_file).read().strip()
        if self.signum != signal.SIGTERM:
            why = " (only SIGTERM saves first, with train.save_on_signal)" if self.save_on_signal else ""
        else:
            why = " (they were outside their training steps)" if self.save_on_signal else \
                " (train.save_on_signal is off)"
        return f"\nultrascale: {name}: stopped the workers at once, without saving{why}"


def kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it (torchrun's workers live in sessions of their own)."""
    try:
        import psutil  # installed with Accelerate

        pids = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except Exception:  # noqa: BLE001 - psutil missing or the process gone: at least the process and its group
        pids = [pid]
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _copy_until(stream, error_file: str) -> None:
    """Copy ``stream`` to this process's standard error as it arrives, dropping what comes once ``error_file``
    exists."""
    out = getattr(sys.stderr, "buffer", None)
    while chunk := stream.read1(1 << 16):
        if os.path.exists(error_file):
            continue
        if out is not None:
            out.write(chunk)
        else:
            sys.stderr.write(chunk.decode(errors="replace"))
        sys.stderr.flush()


def free_port() -> int:
    """A TCP port free on this machine now, for a rendezvous on the loopback (the command line's single-node
    launch, the calibration's worker processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

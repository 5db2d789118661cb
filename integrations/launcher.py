"""Accelerate's launcher, run by this package (``ultrascale accelerate-launch``, and the re-launch of
``accelerate launch --cpu``, see ``cpu_relaunch.py``), so that a configuration error a worker finds is said once.

Under any launcher the workers refuse a layout with one line from rank 0 and exit status 2
(``launch.exit_on_error``). The launcher then reports the failed workers itself: torchrun, which
``accelerate launch`` runs in its own process, logs "failed (exitcode: 2)", raises ``ChildFailedError`` (its
traceback and a summary of every rank's exit code) and exits with status 1 whatever the workers' status was; a
worker cannot change that. Here the workers write the error to ``ULTRASCALE_ERROR_FILE`` instead of printing it,
the launcher's standard error passes through until the file appears and is dropped after it, and the error is
raised here as this process's own ``ConfigError``: one line, exit status 2.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

from ..interface.config import ConfigError


def run_accelerate_launch(launch_args: list[str], env: dict) -> int:
    """``accelerate launch LAUNCH_ARGS`` in ``env``; its exit status, or the ``ConfigError`` a worker reported."""
    with tempfile.TemporaryDirectory(prefix="ultrascale-") as tmp:
        error_file = os.path.join(tmp, "error")
        code = run_launcher([sys.executable, "-m", "accelerate.commands.launch", *launch_args],
                            {**env, "ULTRASCALE_ERROR_FILE": error_file}, error_file)
        if code and os.path.isfile(error_file):
            raise ConfigError(open(error_file).read().strip())
    return code


def run_launcher(cmd: list[str], env: dict, error_file: str) -> int:
    """Run a launcher whose workers report a configuration error into ``error_file``; return its exit status. Its
    standard error passes through as it comes (progress bars included) until a worker has written the error: what
    follows is the job ending because of it, which the caller's one line replaces. The launcher runs in a session
    of its own, and a SIGINT / SIGTERM to this process is passed on to it once (a Ctrl-C at a terminal reaches it
    once, not twice), so that it stops its workers before this process goes on."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True)
    reader = threading.Thread(target=_copy_until, args=(proc.stderr, error_file), daemon=True)
    reader.start()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # (signal handlers belong to the main thread)
        previous = {signum: signal.signal(signum, lambda signum, frame: proc.send_signal(signum))
                    for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    reader.join(timeout=5)  # a worker that outlived the launcher may hold the pipe open
    return code


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

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
import sys
import tempfile

from ..interface.config import ConfigError
from ..distributed.supervisor import TORCHRUN_DEFAULT_GRACE_S, Supervisor, end_by_signal


def run_accelerate_launch(launch_args: list[str], env: dict) -> int:
    """``accelerate launch LAUNCH_ARGS`` in ``env`` under a ``Supervisor`` (a SIGTERM / SIGINT is passed on once and
    bounded by torchrun's default grace; the command then ends by it); its exit status, or the ``ConfigError`` a
    worker reported."""
    supervisor = Supervisor()
    try:
        with tempfile.TemporaryDirectory(prefix="ultrascale-") as tmp:
            error_file = os.path.join(tmp, "error")
            code = supervisor.run([sys.executable, "-m", "accelerate.commands.launch", *launch_args],
                                  {**env, "ULTRASCALE_ERROR_FILE": error_file}, TORCHRUN_DEFAULT_GRACE_S,
                                  own_session=True, error_file=error_file)
            if code and not supervisor.signum and os.path.isfile(error_file):
                raise ConfigError(open(error_file).read().strip())
    finally:
        supervisor.restore()
    if supervisor.signum:
        end_by_signal(supervisor.signum)
    return code

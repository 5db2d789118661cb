"""``accelerate launch --cpu --num_processes N``: N workers, not one.

With ``--cpu`` Accelerate's launcher takes its simple path, which starts a single process unless ``mpirun`` is
used (it only sets MASTER_ADDR/MASTER_PORT when more processes were asked for). Accelerate's multi-process path
(torchrun) runs on CPU with gloo when ``ACCELERATE_USE_CPU`` is set, so the lone process hands over to it: it
re-runs the user's own ``accelerate launch`` arguments with ``--multi_gpu`` in place of ``--cpu`` and exits with
the workers' status. This is the pattern of Lightning's subprocess launcher (re-run the script once per worker);
the arguments are read back from the launcher process and parsed with Accelerate's own parser. A configuration
error the workers find is said once by this process, which exits with status 2 (``launcher.py``).
"""
from __future__ import annotations

import os
import sys

MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
DISTRIBUTED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _truthy(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def single_process_cpu_launch(env=os.environ) -> bool:
    """True in the one process that ``accelerate launch --cpu --num_processes N>1`` (no mpirun) started."""
    return (_truthy(env.get("ACCELERATE_USE_CPU")) and "MASTER_PORT" in env
            and not any(v in env for v in DISTRIBUTED_VARS + MPI_SIZE_VARS))


def launch_arguments(parent_cmdline: list[str]) -> tuple[list[str], list[str]] | None:
    """Split an ``accelerate launch`` command line into (launcher options, script and its arguments);
    None when the command is not ``accelerate launch``."""
    rest = None
    for i, token in enumerate(parent_cmdline):
        name = os.path.basename(token)
        if name in ("accelerate", "accelerate.commands.accelerate_cli") and parent_cmdline[i + 1:i + 2] == ["launch"]:
            rest = parent_cmdline[i + 2:]
            break
        if name in ("accelerate-launch", "accelerate.commands.launch"):
            rest = parent_cmdline[i + 1:]
            break
    if rest is None:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        args = launch_command_parser().parse_args(rest)
    except SystemExit:
        return None
    split = len(rest) - 1 - len(args.training_script_args)
    if split < 0 or rest[split] != args.training_script:
        return None
    return rest[:split], rest[split:]


def relaunch_cpu_workers() -> None:
    """In the lone process of ``accelerate launch --cpu --num_processes N``: run N workers through Accelerate's
    multi-process launcher and exit with their status. Does nothing anywhere else."""
    if not single_process_cpu_launch():
        return
    import psutil  # an Accelerate dependency

    try:
        parent = psutil.Process(os.getppid()).cmdline()
    except (psutil.Error, OSError):
        parent = []
    split = launch_arguments(parent)
    if split is None:
        from ..interface.config import ConfigError

        raise ConfigError("ACCELERATE_USE_CPU and MASTER_PORT are set but this process was not started by "
                          "`accelerate launch`, so the number of CPU workers is unknown. Fix: launch with "
                          "`accelerate launch --cpu --num_processes N script.py`, torchrun, or "
                          "`ultrascale accelerate-launch FILE script.py`")
    options, script = split
    options = [o for o in options if o != "--cpu"] + ["--multi_gpu"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "ULTRASCALE_DEVICE": "cpu"}
    print("ultrascale: `accelerate launch --cpu` starts one process; starting the workers through Accelerate's "
          "multi-process launcher (torchrun, gloo on CPU)", file=sys.stderr, flush=True)
    from ..interface.config import ConfigError
    from ..distributed.launch import exit_on_error
    from .launcher import run_accelerate_launch

    try:
        code = run_accelerate_launch([*options, *script], env)
    except ConfigError as exc:  # a worker's, said once here (or to the launcher above that collects it) instead
        exit_on_error(exc)
    sys.exit(code)

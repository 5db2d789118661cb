"""Process-group set-up from whatever launched us: torchrun / ``ultrascale train`` (RANK, WORLD_SIZE, ...),
SLURM (SLURM_PROCID, SLURM_NTASKS, ...), or nothing (a single process)."""
from __future__ import annotations

import atexit
import datetime
import os
import re
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("ULTRASCALE_TIMEOUT_S", "300"))
_timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


def collective_timeout() -> datetime.timedelta:
    """The bound on every collective of this job (sub-groups of the mesh get it too, see mesh.py)."""
    return _timeout


def set_collective_timeout(timeout: float | datetime.timedelta) -> None:
    """For front ends that create the default process group themselves (Lightning, Accelerate); also registers
    the exit hook that ``init_distributed`` registers for its own group."""
    global _timeout
    _timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
    destroy_process_group_at_exit()


_exit_guard = False
EXIT_SETTLE_S = 0.2


def destroy_process_group_at_exit() -> None:
    """At interpreter exit, destroy the default process group if nobody did, then let gloo settle (idempotent).

    Works around a race in torch's gloo backend, seen in CI as "terminate called without an active exception"
    (SIGABRT) after a run had finished: a gloo worker thread drops its reference to a completed collective only
    after ``wait()`` has returned, and when that is the last reference it frees tensors whose Python objects need
    the GIL. If the interpreter has begun finalizing by then, taking the GIL kills the thread mid-unwind and the
    process aborts (the same report: pytorch/pytorch PR 179291). ``destroy_process_group`` alone does not stop it
    (the groups live on in DeviceMesh / FSDP state), so the hook also releases the GIL for a moment while the
    interpreter is still whole, which lets those threads finish their releases.
    """
    global _exit_guard
    if not _exit_guard:
        _exit_guard = True
        atexit.register(_settle_at_exit)


def _settle_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(EXIT_SETTLE_S)  # releases the GIL: gloo threads waiting for it finish before finalization


def _slurm_env() -> None:
    """Fill torch's variables from SLURM's when the job was started by ``srun`` without torchrun."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        # first host of "node[01-04,07],other" -> "node01"
        m = re.match(r"([^\[,]+)(?:\[(\d+))?", nodes)
        os.environ["MASTER_ADDR"] = (m.group(1) + (m.group(2) or "")) if m else "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))


def device_for_rank() -> torch.device:
    if torch.cuda.is_available() and os.environ.get("ULTRASCALE_DEVICE", "") != "cpu":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(timeout: float | datetime.timedelta | None = None, backend: str | None = None) -> torch.device:
    """Create the default process group (idempotent) and return this rank's device.

    NCCL when a GPU is visible, gloo otherwise. ``timeout`` (seconds) bounds every collective, so a dead peer
    turns into an error instead of a hang.
    """
    device = device_for_rank()
    destroy_process_group_at_exit()
    if dist.is_initialized():
        return device
    _slurm_env()
    global _timeout
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    _timeout = timeout
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:  # a plain `python script.py`: a world of one, so the same code paths run everywhere
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def broadcast_object(obj, src: int = 0):
    """``obj`` as rank ``src`` has it, on every rank (a path every rank must agree on, a rank-0 decision); ``obj``
    itself without a process group. The one helper the front ends and the engine use for this."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def say_once(message: str, env_name: str, printed: str, stream) -> None:
    """Say ``message`` once for a whole launched job rather than once per rank: into the file the launcher named in
    the environment variable ``env_name`` (the first rank to get there writes it; the launcher says it after the
    workers exit), else ``printed`` by global rank 0 on ``stream``."""
    path = os.environ.get(env_name)
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        except OSError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(message)
            return
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        print(printed, file=stream, flush=True)


def report_error(exc: Exception) -> None:
    """A configuration error every rank of a launched job finds alike, said once (``say_once``): into
    ``ULTRASCALE_ERROR_FILE`` when one of the package's launchers (``ultrascale train``, ``ultrascale
    accelerate-launch``) named it, else by global rank 0 as one line on standard error."""
    say_once(f"{exc}", "ULTRASCALE_ERROR_FILE", f"ultrascale: error: {exc}", sys.stderr)


# How long a rank other than 0 waits before it exits with a configuration error that rank 0 says (no launcher's error
# file): a launcher ends the job when its first worker fails, so a rank that exited first could take rank 0 down before
# its line is printed; rank 0's exit ends the wait (the launcher stops the others), and the wait is bounded
SAY_FIRST_S = 30.0


def exit_on_error(exc: Exception, status: int = 2) -> None:
    """``report_error``, then end this process with ``status`` (2: a usage error, as the command line's): the way
    a front end's launched worker refuses a layout, without a traceback from any rank."""
    report_error_and_wait(exc)
    raise SystemExit(status)


def report_error_and_wait(exc: Exception) -> None:
    """``report_error``; then, on a rank other than 0 of a launched job whose line rank 0 says, wait (at most
    ``SAY_FIRST_S``) so that this rank's exit does not end the job before rank 0 printed it."""
    report_error(exc)
    if not os.environ.get("ULTRASCALE_ERROR_FILE") and (launched_world_size() or 1) > 1 and \
            int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) != 0:
        time.sleep(SAY_FIRST_S)


def launched_world_size() -> int | None:
    """The number of processes torchrun or SLURM started (on every node), or None outside a launcher (read from
    their variables: no process group is needed)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ:
        return int(os.environ.get("SLURM_NTASKS", "1"))
    return None


def refuse(exc: Exception, world: int | None = None) -> NoReturn:
    """A configuration error, as every front end says it: in a launched job of ``world`` processes (default: what
    the launcher started), or under one of the package's launchers that says a worker's error itself, one line for
    the whole job and exit status 2 (``exit_on_error``) rather than a traceback from every rank; in a single
    process, raised as any exception, for a caller to catch."""
    world = world if world is not None else (launched_world_size() or 1)
    if world > 1 or os.environ.get("ULTRASCALE_ERROR_FILE"):
        exit_on_error(exc)
    raise exc

"""Process-group set-up from whatever launched us: torchrun / ``ultrascale train`` (RANK, WORLD_SIZE, ...),
SLURM (SLURM_PROCID, SLURM_NTASKS, ...), or nothing (a single process)."""
from __future__ import annotations

import atexit
import datetime
import os
import re

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("ULTRASCALE_TIMEOUT_S", "300"))
_timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


def collective_timeout() -> datetime.timedelta:
    """The bound on every collective of this job (sub-groups of the mesh get it too, see mesh.py)."""
    return _timeout


def set_collective_timeout(timeout: float | datetime.timedelta) -> None:
    """For front ends that create the default process group themselves (Lightning, Accelerate)."""
    global _timeout
    _timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
    destroy_process_group_at_exit()


_exit_guard = False


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, if nobody did (idempotent).

    A script that ends without ``destroy_process_group`` / ``accelerator.end_training()`` leaves gloo's and DDP's
    native threads to the C++ static destructors; the clean-clone CI saw one such exit abort ("terminate called
    without an active exception", SIGABRT) after the training had finished, failing the launch.
    """
    global _exit_guard
    if not _exit_guard:
        _exit_guard = True
        atexit.register(_destroy_if_initialized)


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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

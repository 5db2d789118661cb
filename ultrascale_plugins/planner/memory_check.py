"""The memory check before a launch: the planner's per-rank memory estimate of a layout (its most loaded rank)
against what each process may use, a GPU's memory or its share of this machine's. Here, below the front ends,
because every front end that launches asks it: ``ultrascale train`` (``cli/main.check_recipe``) and the TRL
trainers (DPO's reference, ``integrations/trl``)."""
from __future__ import annotations

import os

from ..interface.config import ConfigError


def machine_memory_gb(nproc: int) -> tuple[float, str]:
    """(GB each local process may use, how that was found): a GPU's memory when the workers get GPUs, else the
    machine's RAM (or its cgroup limit, when lower) split over the ``nproc`` local processes."""
    import torch

    if torch.cuda.is_available() and os.environ.get("ULTRASCALE_DEVICE", "") != "cpu":
        count = torch.cuda.device_count()
        gb = min(torch.cuda.get_device_properties(i).total_memory for i in range(min(nproc, count))) / 1e9
        return gb, f"{gb:.1f} GB per GPU ({torch.cuda.get_device_name(0)})"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    gb, plural = total / 1e9, "es" if nproc > 1 else ""
    return gb / nproc, f"{gb:.1f} GB of memory for {nproc} process{plural} ({gb / nproc:.1f} GB each)"


def check_memory(resolved, model_config, model, world: int, seq_len: int, micro_batch: int, micro_batches: int,
                 local_processes: int, memory_gb: float | None = None, optimizer: str = "adamw") -> dict | None:
    """Refuse a model that cannot fit: the planner's per-rank memory estimate of the layout (the most loaded
    rank) against ``memory_gb`` per process, or else each local process's share of this machine's memory; returns
    that estimate (GB by category, ``peak_memory_gb``). ``ULTRASCALE_SKIP_MEMORY_CHECK=1`` launches anyway (None)."""
    if os.environ.get("ULTRASCALE_SKIP_MEMORY_CHECK", "") not in ("", "0"):
        return None
    from ..core.engine import estimate
    from .cost import coordinates_to_cost, peak_memory_gb

    ests = [estimate(resolved, model_config, world_size=world, seq_len=seq_len, micro_batch=micro_batch,
                     micro_batches=micro_batches, coords=coords, model=model, check=False, optimizer=optimizer)
            for coords in coordinates_to_cost(resolved)]
    mem = peak_memory_gb(ests)
    have, where = ((memory_gb, f"{memory_gb:g} GB per GPU") if memory_gb is not None
                   else machine_memory_gb(local_processes))
    if mem["total"] <= have:
        return mem
    n_params = sum(p.numel() for p in model.parameters())
    parts = ", ".join(f"{k} {mem[k]:.1f}" for k in ("params", "grads", "optimizer", "activations", "other"))
    raise ConfigError(f"model {model_config.model_type} ({n_params / 1e9:.2f}B parameters) needs about "
                      f"{mem['total']:.1f} GB per process in this layout ({parts} GB: the planner's estimate, "
                      f"`ultrascale plan`), but this machine has {where}. Fix: set the model's sizes in the recipe "
                      "(num_hidden_layers, hidden_size, vocab_size, ...), shard it over more processes or nodes "
                      "(zero_stage: 3, tp, pp), or set ULTRASCALE_SKIP_MEMORY_CHECK=1 to launch anyway")

"""``layout: auto``: the planner's best layout for the actual world size, model and hardware.

A built-in plugin: it declares the ``layout`` field (``manual`` | ``auto``) and the two workload figures the
planner needs that a layout does not otherwise hold (``auto_seq_len``, ``auto_global_batch``; recipes fill them
from their ``data``/``train`` sections), and answers ``ultrascale_validate_choose_layout``, which ``engine.validate`` — the
path of every front end before any process group — asks first: an ``auto`` layout becomes the chosen one, and
the reason is logged (rank 0).
"""
from __future__ import annotations

import os
import sys

from ..interface.hookspecs import hookimpl

_ANNOUNCED: set = set()
_ENV = "ULTRASCALE_AUTO_LAYOUT"


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("layout", str, "manual", "auto: the planner picks every degree, ZeRO stage, recomputation and "
               "schedule for the world size, model and hardware, and the plugin fields it searches (ep for a "
               "mixture of experts); the layout fields it picks are ignored, mixed_precision excepted, the others "
               "(e.g. compile and float8) are kept", choices=("manual", "auto"))
    fields.add("auto_seq_len", int, 0, "layout: auto plans for this sequence length (0: the model's maximum, "
               "at most 4096)", minimum=0)
    fields.add("auto_global_batch", int, 0, "layout: auto plans for this many sequences per step (0: one per "
               "process)", minimum=0)
    fields.add("auto_micro_batch_size", int, 0, "set by layout: auto: the rows per micro-batch it planned for "
               "(recipes take it unless they set train.micro_batch_size or train.grad_accum)", minimum=0)


@hookimpl
def ultrascale_validate_choose_layout(config, model_config, world_size):
    if getattr(config, "layout", "manual") != "auto":
        return None
    if model_config is None:
        from ..interface.config import ConfigError

        raise ConfigError("layout: auto needs the model to plan for. Fix: give the model (or its config), or a "
                          "manual layout")
    chosen, _, why = choose_layout(config, model_config, world_size)
    announce(why)
    return chosen


def detect_hardware(world_size: int):
    """The GPUs of this machine as a planner ``Hardware`` (a preset when the name matches one), or the CPU."""
    from .hardware import PRESETS, Hardware

    import torch

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name, memory = props.name.lower(), props.total_memory / 1e9
        per_node = per_node or torch.cuda.device_count()
        for key, preset in PRESETS.items():
            chip = key.split("-")[0]
            if chip in name.replace(" ", "") and abs(preset.memory_gb - memory) / preset.memory_gb < 0.2:
                return Hardware(preset.name, memory, preset.tflops, preset.intra_node_gbps, preset.inter_node_gbps,
                                per_node)
        return Hardware(props.name, memory, 312.0, 100.0, 12.5, per_node)  # an unknown GPU: A100-class guess
    from .machine_bench import host_memory_gb

    per_node = per_node or world_size
    ram = host_memory_gb()
    # CPU processes: a share of the RAM each, ~50 GFLOP/s, memory-copy links (gloo over loopback)
    return Hardware("cpu", ram / max(1, per_node), 0.05, 5.0, 1.0, per_node)


# the fields an auto layout resets where the chosen layout leaves them out: those the search chooses itself
# (``cost.SEARCH_SETS``), ``layout``, and the two that follow the degrees it picks (a manual split of the layers or of
# the logits is for the manual degrees); the plugin fields the search tried (``ultrascale_cost_search``) too
FOLLOW_THE_DEGREES = {"loss_parallel", "pp_split"}


def choose_layout(config, model_config, world_size: int, hardware=None):
    """(the concrete ``ParallelConfig``, the chosen planner ``Result``, a one-line reason) for an auto layout: the
    planner's ranking, so a layout with room for the memory estimate's error is chosen whenever any has it, and a
    faster one at the edge is named beside it (``headroom``); at the edge, where the room is found."""
    from ..interface.config import ParallelConfig
    from .cost import SEARCH_SETS, CostModel, Workload
    from .model_spec import ModelSpec
    from .search import best_layout, search

    hw = hardware or detect_hardware(world_size)
    seq = config.auto_seq_len or min(getattr(model_config, "max_position_embeddings", 4096) or 4096, 4096)
    batch = config.auto_global_batch or world_size
    precision = "bf16" if config.mixed_precision == "bf16" else "no"
    cost = CostModel(ModelSpec.of(model_config), hw, Workload(seq, batch, "ultrascale", "adamw", precision),
                     pm=config.registry)
    ranked = search(cost, world_size, lossy=False)  # bf16 states change the numbers: the user's choice, not ours
    best = best_layout(cost, world_size, ranked)
    # what the planner does not choose (compile, float8, prefetch, the ring's kernel, ...) is the user's, kept; a
    # plugin field it searched (ep) is its choice, at the field's default when the chosen layout leaves it out
    reset = SEARCH_SETS | FOLLOW_THE_DEGREES | {"layout"} | cost.searched
    kept = {k: v for k, v in config.to_dict().items() if k not in reset}
    fields = {**kept, **best.layout.fields(), "auto_seq_len": config.auto_seq_len,
              "auto_global_batch": config.auto_global_batch, "auto_micro_batch_size": best.layout.micro_batch_size}
    assumed = [f"{name}={value}" for name, value, given in (("auto_seq_len", seq, config.auto_seq_len),
                                                             ("auto_global_batch", batch, config.auto_global_batch))
               if not given]
    note = (f" (assumed {' and '.join(assumed)}: set them to the run's sequence length and sequences per step, "
            "e.g. UltraScaleStrategy(layout='auto', auto_seq_len=2048, auto_global_batch=64); recipes set them "
            "from data.seq_len and train.global_batch)") if assumed else ""
    why = (f"layout: auto chose {best.layout.label()} for {world_size} x {hw.name}, sequence {seq}, "
           f"global batch {batch}{note}: predicted {best.memory_gb['total']:.1f} of {hw.memory_gb:.0f} GB per device "
           f"({_room(best, hw)}), {best.tokens_per_s_per_gpu:,.0f} tokens/s/device, mostly {best.dominant}; best of "
           f"{len(ranked)} costed layouts{_beside(best, ranked, cost, world_size)}")
    return ParallelConfig(**fields), best, why


def _room(best, hw) -> str:
    from .headroom import MEMORY_MARGIN, has_headroom

    if has_headroom(best, hw.memory_gb):
        return f"with room for the memory estimate's {MEMORY_MARGIN:.1%} margin"
    return f"at the edge: less free than the memory estimate's {MEMORY_MARGIN:.1%} margin, it may run out of memory"


def _beside(best, ranked, cost, world_size: int) -> str:
    """What the reason says after the choice: the faster layout at the edge it was chosen over, with its risk; at
    the edge itself, where a layout with the margin is found (more GPUs, a memory saver); else the runner-up."""
    from .headroom import edge_risk, faster_at_the_edge, has_headroom
    from .render import room_elsewhere_text
    from .search import room_elsewhere

    limit = cost.hw.memory_gb
    if not has_headroom(best, limit):
        return ". " + room_elsewhere_text(best, room_elsewhere(cost, world_size, ranked), limit, frozenset(cost.savers))
    edge = faster_at_the_edge(best, ranked, limit)
    if edge is not None:
        return f"; chosen over a faster layout at the edge: {edge_risk(edge, best, limit)}"
    runner = next((r for r in ranked[1:] if r.layout.label() != best.layout.label()), None)
    if runner is None:
        return ""
    return (f" (next: {runner.layout.label()}, {runner.tokens_per_s_per_gpu:,.0f} tokens/s, "
            f"{runner.memory_gb['total']:.1f} GB)")


def _rank() -> int:
    """This process's global rank: the process group's once it exists (Lightning's workers have no RANK variable),
    else the launcher's variables (torchrun: RANK; a node's first process: LOCAL_RANK and NODE_RANK 0)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return int(os.environ.get("LOCAL_RANK", 0)) + int(os.environ.get("NODE_RANK", 0))


def announce(why: str) -> None:
    """Log the choice once: on rank 0 only (every rank makes the same choice), and not again in workers whose
    launcher already said it (the environment carries it to them)."""
    if why in _ANNOUNCED or _rank() != 0 or os.environ.get(_ENV) == why:
        return
    _ANNOUNCED.add(why)
    os.environ[_ENV] = why
    print(f"ultrascale: {why}", file=sys.stderr, flush=True)

"""Named layouts for front ends whose users give only a name and a device count (``Trainer(strategy=NAME,
devices=N)``). Each rule picks the degrees from the world size, the devices per node and the model:

- ``default`` (``ultrascale``): the layout in ``$ULTRASCALE_CONFIG`` (a YAML file) if set, else ZeRO-3 over every
  device.
- ``zero3`` / ``zero2``: one sharded data-parallel group over every device (parameters + gradients + optimizer
  state sharded, or gradients + optimizer state only).
- ``tp`` / ``tp_sp``: tensor parallel within a node — the largest divisor of the devices per node that divides
  the attention and key/value head counts — and ZeRO-3 across the rest; ``tp_sp`` adds sequence parallel.
- ``pp``: pipeline parallel across nodes (pp = nodes), or over 2 devices on one node; 1F1B with pp
  micro-batches; ZeRO-3 over the rest.
"""
from __future__ import annotations

from ..config import ConfigError, ParallelConfig

PRESETS = {
    "default": ("default", "every device in one ZeRO-3 group, or the layout in $ULTRASCALE_CONFIG"),
    "zero3": ("zero3", "ZeRO-3 (FSDP2) over every device"),
    "zero2": ("zero2", "ZeRO-2 (FSDP2, parameters kept whole) over every device"),
    "tp": ("tp", "tensor parallel within a node, ZeRO-3 across"),
    "tp_sp": ("tp_sp", "tensor + sequence parallel within a node, ZeRO-3 across"),
    "pp": ("pp", "pipeline parallel across nodes (2 stages on one node), 1F1B, ZeRO-3 over the rest"),
}


def tp_degree(devices_per_node: int, model_config) -> int:
    heads = getattr(model_config, "num_attention_heads", None) or 1
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    return max(d for d in range(1, devices_per_node + 1)
               if devices_per_node % d == 0 and heads % d == 0 and kv % d == 0)


def config_for_preset(preset: str, world: int, devices_per_node: int, model_config) -> ParallelConfig:
    if preset not in PRESETS:
        raise ConfigError(f"preset={preset!r}: unknown. Fix: one of {', '.join(PRESETS)}")
    if preset in ("default", "zero3"):
        return ParallelConfig(dp_shard=world, zero_stage=3)
    if preset == "zero2":
        return ParallelConfig(dp_shard=world, zero_stage=2)
    if preset in ("tp", "tp_sp"):
        tp = tp_degree(devices_per_node, model_config)
        return ParallelConfig(tp=tp, dp_shard=world // tp, sequence_parallel=(preset == "tp_sp" and tp > 1))
    nodes = max(1, world // devices_per_node)
    pp = nodes if nodes > 1 else min(2, world)
    if world % pp:
        raise ConfigError(f"strategy 'ultrascale_pp': {world} devices do not split into {pp} pipeline stages. "
                          "Fix: use an even number of devices")
    return ParallelConfig(pp=pp, dp_shard=world // pp, pp_schedule="1f1b")

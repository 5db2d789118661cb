"""Per-rank memory and communication estimates (formulas in the project's reference notes: Ultra-Scale
Playbook, Korthikanti et al. 2022). Each dimension's plugin adds its own terms through ``ultrascale_estimate``;
``engine.estimate`` collects them into an ``Estimate``."""
from __future__ import annotations

import dataclasses

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "other")


@dataclasses.dataclass
class Estimate:
    """Bytes per rank by memory category, bytes per rank per step by mesh axis, and factors (e.g. recompute)."""

    memory: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(MEMORY_CATEGORIES, 0.0))
    comm: dict = dataclasses.field(default_factory=dict)
    factors: dict = dataclasses.field(default_factory=dict)

    def add_memory(self, category: str, nbytes: float) -> None:
        if category not in self.memory:
            raise ValueError(f"memory category {category!r}: one of {', '.join(MEMORY_CATEGORIES)}")
        self.memory[category] += float(nbytes)

    def add_comm(self, axis: str, nbytes: float) -> None:
        self.comm[axis] = self.comm.get(axis, 0.0) + float(nbytes)

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())


def parameter_count(mc) -> int:
    """Llama-style decoder parameter count from a Hugging Face config."""
    h = mc.hidden_size
    heads = mc.num_attention_heads
    kv = getattr(mc, "num_key_value_heads", None) or heads
    head_dim = getattr(mc, "head_dim", None) or h // heads
    ffn = getattr(mc, "intermediate_size", None) or 4 * h
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    mlp = 3 * h * ffn
    per_layer = attn + mlp + 2 * h
    embed = mc.vocab_size * h * (1 if getattr(mc, "tie_word_embeddings", False) else 2)
    return mc.num_hidden_layers * per_layer + embed + h


def data_parallel_terms(config, mc, est: Estimate) -> None:
    from .parallel_dims import ParallelDims

    dims = ParallelDims(config)
    psi = parameter_count(mc) / (dims.degree("tp") * dims.degree("pp"))
    dp, shard = dims.dp, dims.degree("dp_shard")
    half = 2 if config.mixed_precision == "bf16" else 4
    weights, grads, optim = half * psi, half * psi, (12 if half == 2 else 8) * psi
    if config.zero_stage == 3:
        weights, grads, optim = weights / shard, grads / shard, optim / shard
    elif config.zero_stage == 2:
        grads, optim = grads / shard, optim / shard
    elif config.zero_stage == 1:
        optim = optim / dp
    est.add_memory("params", weights)
    est.add_memory("grads", grads)
    est.add_memory("optimizer", optim)
    if dp > 1:
        factor = 3 if config.zero_stage == 3 else 2  # all-gather fwd + bwd + reduce-scatter vs one all-reduce
        volume = factor * half * psi * (dp - 1) / dp
        axes = [a for a in ("dp_replicate", "dp_shard") if dims.enabled(a)]
        for axis in axes:  # HSDP: split between the two axes by their share of the ranks
            est.add_comm(axis, volume / len(axes))


def tensor_parallel_terms(config, mc, seq_len: int, micro_batch: int, est: Estimate) -> None:
    if config.tp == 1:
        return
    act = seq_len * micro_batch * mc.hidden_size * 2
    # 2 all-reduces forward + 2 backward per layer (SP: all-gather + reduce-scatter, same volume)
    est.add_comm("tp", 4 * 2 * act * (config.tp - 1) / config.tp * mc.num_hidden_layers / config.pp)


def activation_terms(config, mc, seq_len: int, micro_batch: int, est: Estimate) -> None:
    """Activations per layer (Korthikanti et al.: s*b*h*(34 + 5*a*s/h) bytes in 16-bit), divided by tp (and by
    tp again for the sequence-parallel part), 2*s*b*h per layer with full recomputation."""
    s, b, h = seq_len, micro_batch, mc.hidden_size
    a = mc.num_attention_heads
    layers = mc.num_hidden_layers / config.pp
    per_layer = s * b * h * (34 + 5 * a * s / h)
    if config.tp > 1:
        per_layer = s * b * h * (10 + 24 / config.tp + 5 * a * s / (h * config.tp))
        if config.sequence_parallel:
            per_layer = s * b * h * (34 + 5 * a * s / h) / config.tp
    if config.activation_checkpointing == "full":
        per_layer = 2 * s * b * h
        est.factors["recompute_flops"] = 1.33
    elif config.activation_checkpointing == "selective":
        per_layer = s * b * h * 34 / max(config.tp if config.sequence_parallel else 1, 1)
        est.factors["recompute_flops"] = 1.03
    est.add_memory("activations", per_layer * layers * (4 / 2 if config.mixed_precision != "bf16" else 1))

"""Per-rank memory and communication estimates (formulas in the project's reference notes: Ultra-Scale
Playbook, Korthikanti et al. 2022). Each dimension's plugin adds its own terms through ``ultrascale_estimate``."""
from __future__ import annotations


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


def data_parallel_terms(config, mc, est) -> None:
    psi = parameter_count(mc) / (config.tp * config.pp)
    dp = config.dp_replicate * max(config.dp_shard, 1)
    shard = max(config.dp_shard, 1)
    half = 2 if config.mixed_precision in ("bf16", "fp16") else 4
    weights, grads, optim = half * psi, half * psi, (12 if half == 2 else 8) * psi
    if config.zero_stage == 3:
        weights, grads, optim = weights / shard, grads / shard, optim / shard
    elif config.zero_stage == 2:
        grads, optim = grads / shard, optim / shard
    elif config.zero_stage == 1:
        optim = optim / dp
    est["model_states_bytes"] = est.get("model_states_bytes", 0) + weights + grads + optim
    if dp > 1:
        factor = 3 if config.zero_stage == 3 else 2  # all-gather fwd + bwd + reduce-scatter vs one all-reduce
        est["dp_comm_bytes"] = factor * half * psi * (dp - 1) / dp


def tensor_parallel_terms(config, mc, seq_len: int, micro_batch: int, est) -> None:
    if config.tp == 1:
        return
    act = seq_len * micro_batch * mc.hidden_size * 2
    # 2 all-reduces forward + 2 backward per layer (SP: all-gather + reduce-scatter, same volume)
    est["tp_comm_bytes"] = 4 * 2 * act * (config.tp - 1) / config.tp * mc.num_hidden_layers / config.pp

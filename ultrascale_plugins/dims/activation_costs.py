"""Activation memory: what autograd keeps for backward per token and layer (Korthikanti et al. 2022's tensors with
flash-style attention), divided by TP and SP, reduced by recomputation, times the micro-batches the schedule holds
in flight, plus the loss's logits on the rank that holds the head (checked against what autograd saves on the CPU:
tests/test_estimates.py)."""
from __future__ import annotations

from ..interface.estimates import Estimate, expert_share


def activation_bytes_per_token(mc, config, mode: str, element: int) -> tuple[float, float, float, float]:
    """(bytes per token per layer saved for backward that TP shards, that only SP shards, that neither does, and
    one layer's working set while it is recomputed). Flash-style attention (no score matrix), Korthikanti's
    accounting per tensor: norm inputs/outputs, q/k/v, rotated q/k, attention output, MLP intermediates (4 of
    the FFN width for a gated MLP, 2 otherwise)."""
    h = mc.hidden_size
    heads = getattr(mc, "num_attention_heads", None) or 1
    head_dim = getattr(mc, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = (getattr(mc, "num_key_value_heads", None) or heads) * head_dim
    ffn = _ffn_width(mc)
    gated = getattr(mc, "hidden_act", "gelu") in ("silu", "swiglu", "geglu", "gelu_pytorch_tanh") and \
        getattr(mc, "model_type", "") not in ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi")
    mlp = (4 if gated else 2) * ffn
    # the two norms' inputs (the residual stream) are split by SP; their outputs feed the column-parallel matmuls,
    # which keep their input whole for the weight gradient (all-gathered under SP: torch's styles and nanotron
    # alike), so TP never divides those
    sp_only, whole = 3 * h, 1 * h
    tp_part = (q + 2 * kv) + (q + kv) + q + mlp
    layer = element * (sp_only + whole + tp_part)
    if mode == "full":
        return 0.0, element * h, 0.0, layer
    if mode == "selective":  # keeps matmul and attention outputs; recomputes norms and element-wise work
        return element * ((q + 2 * kv) + q + 2 * ffn), element * h, element * 2 * h, 0.0
    return element * tp_part, element * sp_only, element * whole, 0.0


def _ffn_width(mc) -> int:
    h = mc.hidden_size
    dense = getattr(mc, "intermediate_size", None) or getattr(mc, "n_inner", None) or 4 * h
    moe = getattr(mc, "moe_intermediate_size", None)
    if moe and expert_share(mc) < 1:
        k = next((getattr(mc, a) for a in ("num_experts_per_tok", "moe_top_k", "top_k") if getattr(mc, a, None)), 1)
        shared = getattr(mc, "n_shared_experts", 0) or 0
        return moe * (k + shared)
    if expert_share(mc) < 1:
        k = next((getattr(mc, a) for a in ("num_experts_per_tok", "moe_top_k", "top_k") if getattr(mc, a, None)), 1)
        return dense * k
    return dense


def activation_terms(config, shape, est: Estimate) -> None:
    """Activations saved for backward on this rank: its layers x the micro-batches its schedule holds in flight,
    divided by TP (and SP), plus the loss's logits on the rank that holds the head."""
    mc = shape.model_config
    element = shape.activation_bytes(config)
    mode = config.activation_checkpointing
    tp = config.tp
    tp_part, sp_part, whole, working = activation_bytes_per_token(mc, config, mode, element)
    sp_div = tp if config.sequence_parallel else 1
    per_token = tp_part / tp + sp_part / sp_div + whole
    tokens = shape.tokens_per_micro_batch
    layers = shape.layers_here if shape.layers_here is not None else mc.num_hidden_layers
    saved = per_token * tokens * layers * shape.in_flight
    if mode != "none":
        saved += working / tp * tokens  # full recomputation: one layer's activations while it is recomputed
        est.factors["recompute_flops"] = 4 / 3 if mode == "full" else 1.03
    est.add_memory("activations", saved)
    if shape.holds_head:
        vocab_div = tp if (config.loss_parallel or shape.profile == "nanotron") else 1
        # logits in the compute dtype, their fp32 copy for the loss and its gradient
        logits = (element + 8) * mc.vocab_size * tokens / vocab_div + element * mc.hidden_size * tokens
        est.add_memory("activations", logits)

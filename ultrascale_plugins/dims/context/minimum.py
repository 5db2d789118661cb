"""Context parallel's least communication for one optimizer step on one rank (``ultrascale_cost_comm_minimum``), in the
notation of ``interface.comm_minimum``: the ring passes keys and values cp-1 times forward and keys, values and
their gradients backward; Ulysses exchanges q, k, v and the output forward and their gradients backward."""
from __future__ import annotations

from ...interface.comm_minimum import MinimumTerm, layers, tokens
from ...interface.facts import layout_facts
from ...interface.moe_config import text_config


def context_minimum(config, shape) -> list[MinimumTerm]:
    """The ``cp`` axis's attention exchanges (the gradients' all-reduce over cp is data parallel's term)."""
    cp = config.cp
    if cp == 1:
        return []
    text = text_config(shape.model_config)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    facts = layout_facts(config)
    tp, recompute = facts.degree("tp"), facts.recompute == "full"
    m, n = shape.micro_batches, layers(shape)
    width = shape.activation_bytes(config) * tokens(config, shape) * head_dim
    if config.cp_method == "ring":
        chunk = 2 * kv / tp * width  # this rank's keys and values
        passes = 3 + (1 if recompute else 0)  # forward k/v, backward k/v and dk/dv (+ the recomputed forward)
        calls = 2 * passes * (cp - 1) * n * m
        again = " (+ the recomputed forward)" if recompute else ""
        return [MinimumTerm("cp", "p2p", calls, calls * chunk,
                            f"per layer and micro-batch: keys and values passed cp-1 times forward, and keys, values "
                            f"and their gradients cp-1 times each backward{again}; each of b·(s/cp)·2·h_kv·d, "
                            "counted at both ends")]
    per_layer = 2 * (2 * heads + 2 * kv) / tp * width  # q, k, v and the output, forward and backward
    calls = 8 * n * m
    extra = (4 * n * m, (2 * heads + 2 * kv) / tp * width * n * m) if recompute else (0, 0)
    return [MinimumTerm("cp", "all_to_all", calls + extra[0], per_layer * n * m + extra[1],
                        "per layer and micro-batch: q, k, v and the output exchanged forward and their gradients "
                        "backward, each the rank's b·(s/cp)·heads·d")]

"""Expert parallel's least communication for one optimizer step on one rank (``ultrascale_cost_comm_minimum``), in the
notation of ``interface.comm_minimum``: per MoE layer, each token's top-k copies dispatched and combined, forward
and backward."""
from __future__ import annotations

from ...interface.comm_minimum import MinimumTerm, tokens
from ...interface.facts import layout_facts
from ...interface.moe_config import experts_per_token, text_config


def expert_minimum(config, shape) -> list[MinimumTerm]:
    """The ``ep`` axis's all-to-alls, for the MoE layers this rank holds (the expert view's records)."""
    if config.ep == 1:
        return []
    moe_layers = {r.layer for r in shape.inventory if r.view and r.layer is not None}
    if not moe_layers:
        return []
    text = text_config(shape.model_config)
    top_k = experts_per_token(text)
    facts = layout_facts(config)
    # the ranks holding the same tokens (tensor parallel) each route a slice of them
    one = -(-tokens(config, shape) // facts.degree("tp")) * top_k * text.hidden_size * shape.activation_bytes(config)
    recompute = facts.recompute != "none"
    passes = 4 + (2 if recompute else 0)
    calls = passes * len(moe_layers) * shape.micro_batches
    return [MinimumTerm("ep", "all_to_all", calls, calls * one,
                        f"per MoE layer ({len(moe_layers)}) and micro-batch: dispatch and combine, forward and "
                        f"backward{' and recomputed' if recompute else ''}, each the rank's tokens × top-k "
                        f"({top_k}) × h")]

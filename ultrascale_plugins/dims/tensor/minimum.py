"""Tensor parallel's least communication for one optimizer step on one rank (``ultrascale_cost_comm_minimum``):
Megatron-LM's count per block and at the ends of the model, in the notation of ``interface.comm_minimum``. Per
layer and micro-batch two all-reduces of A forward and two backward (sequence parallel: an all-gather and a
reduce-scatter in their place), one at each end the plan shards, and what the loss needs of the logits."""
from __future__ import annotations

from ...interface.comm_minimum import MinimumTerm, activation, layers, tokens
from ...interface.facts import layout_facts
from ...interface.moe_config import text_config


def tensor_minimum(config, shape) -> list[MinimumTerm]:
    """The ``tp`` axis's terms: the blocks' collectives, the ends' and the loss's."""
    if config.tp == 1:
        return []
    m, n = shape.micro_batches, layers(shape)
    act = activation(config, shape)
    recompute = layout_facts(config).recompute == "full"
    matched = shape.plan.matches(shape.model) if shape.plan is not None and shape.model is not None else {}
    # the ends, where the plan shards them: a vocabulary-parallel embedding's output, the head's input gradient
    embedding = _holds(shape, "pre") and matched.get(shape.plan.embedding) in ("embedding_rowwise",
                                                                                "vocab_parallel_embedding")
    head = shape.holds_head and (shape.plan is None or shape.plan.lm_head in matched)
    ends = int(embedding) + int(head)
    loss = _loss(config, shape) if head else []
    if config.sequence_parallel:
        per_layer = 2 + (1 if recompute else 0)  # of each kind, forward + backward (+ the recomputed forward)
        gathers = m * (2 * per_layer * n + int(_holds(shape, "pre")) + int(head))
        scatters = m * (2 * per_layer * n + ends)
        rec = " + 1 recomputed" if recompute else ""
        return [MinimumTerm("tp", "all_gather", gathers, gathers * act,
                            f"per micro-batch: 2 forward + 2 backward{rec} per layer ({n}) + 1 per end held "
                            "(the embedding's backward, the head's input), each the whole b·s·h"),
                MinimumTerm("tp", "reduce_scatter", scatters, scatters * act,
                            f"per micro-batch: 2 forward + 2 backward{rec} per layer + 1 per sharded end held "
                            f"({ends}: a vocabulary-parallel embedding's output, the head's input gradient)"),
                *loss]
    per_layer = 4 + (2 if recompute else 0)
    reduces = m * (per_layer * n + ends)
    return [MinimumTerm("tp", "all_reduce", reduces, reduces * act,
                        f"per micro-batch: {per_layer} per layer ({n}; 2 forward, 2 backward"
                        f"{', 2 recomputed' if recompute else ''}) + 1 per sharded end held ({ends}: a "
                        "vocabulary-parallel embedding's output, the head's input gradient), each b·s·h"),
            *loss]


def _loss(config, shape) -> list[MinimumTerm]:
    """What the loss needs of the logits, on the rank holding the head."""
    m, t = shape.micro_batches, tokens(config, shape)
    chunk = layout_facts(config).loss_chunk
    if chunk:  # the chunked loss: vocabulary-parallel, max then (sum of exps, target logit) per chunk
        return [MinimumTerm("tp", "all_reduce", 2 * m * -(-t // chunk), 3 * m * t * 4,
                            "vocabulary-parallel loss: 3 fp32 values per token (max, sum of exps, target logit)")]
    if config.loss_parallel:  # vocabulary-parallel cross-entropy: max, target logit, sum of exps
        return [MinimumTerm("tp", "all_reduce", 3 * m, 3 * m * t * 4,
                            "vocabulary-parallel loss: 3 per micro-batch of b·s fp32 values")]
    vocab = getattr(text_config(shape.model_config), "vocab_size", 0)  # the loss needs every logit: gathered
    return [MinimumTerm("tp", "all_gather", m, m * t * vocab * shape.activation_bytes(config),
                        "the logits, b·s·V per micro-batch, gathered for the loss (loss_parallel keeps them "
                        "sharded)")]


def _holds(shape, part: str) -> bool:
    return any(r.part == part for r in shape.inventory)

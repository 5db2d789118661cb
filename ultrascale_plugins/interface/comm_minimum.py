"""The least communication a layout needs for one optimizer step on one rank: the Ultra-Scale Playbook's formulas
(with Megatron-LM's count at the ends of a tensor-parallel model), per mesh axis and collective, in the units the
communication ledger measures (``comm_ledger``: the payload is the whole tensor a collective is about, and a
point-to-point transfer counts on both ends, the send and the receive).

A minimum keeps what the layout promises to shard: ZeRO-2 keeps gradients sharded across an accumulation window, so
it reduce-scatters every micro-batch; ZeRO-3 keeps parameters sharded between uses, so it gathers them for every
forward and backward. Each term says its formula (``formula``); docs/performance.md explains them and their sources.
The built-in dimensions are named here, as ``ParallelDims.describe`` names them; another plugin's axis has no
minimum (its rows say so).

Notation: b rows per micro-batch, s the sequence (s/cp per rank), h the hidden size, m micro-batches per step, A =
b·s·h bytes of one activation in the compute dtype, Ψg the bytes of this rank's trainable parameters in fp32 (its
tensor- and pipeline-parallel share) and Ψw the bytes of its weights in the compute dtype.
"""
from __future__ import annotations

import dataclasses
import math

from .facts import layout_facts
from .moe_config import experts_per_token, text_config

V_SHAPED = ("zbv", "dualpipev")  # a pipeline's V schedules: rank r holds stages r and 2p-1-r


@dataclasses.dataclass
class MinimumTerm:
    """``calls`` collectives of kind ``op`` on mesh axis ``axis`` moving ``payload`` bytes in all, per optimizer
    step; ``op`` "p2p" counts sends and receives together."""

    axis: str
    op: str
    calls: int
    payload: float
    formula: str


def minimum_terms(config, shape) -> list[MinimumTerm]:
    """The minimum for the rank ``shape`` describes, after every dimension's ``ultrascale_estimate`` has cut its
    inventory (tensor and pipeline parallel's share, expert parallel's experts) and set ``layers_here``."""
    out: list[MinimumTerm] = []
    for part in (_tensor, _pipeline, _context, _experts, _data):
        out.extend(part(config, shape))
    return [t for t in out if t.calls > 0]


def _degree(config, name: str) -> int:
    return int(getattr(config, name, 1) or 1)


def _act_bytes(config, shape) -> int:
    return shape.activation_bytes(config)


def _tokens(config, shape) -> int:
    """This rank's tokens of one micro-batch: b · s/cp."""
    return shape.micro_batch * -(-shape.seq_len // _degree(config, "cp"))


def _layers(shape) -> int:
    return shape.layers_here if shape.layers_here is not None else shape.model_config.num_hidden_layers


def _holds(shape, part: str) -> bool:
    return any(r.part == part for r in shape.inventory)


def _text_config(shape):
    return text_config(shape.model_config)


# ---- tensor parallel: Megatron's count per block and at the ends ------------------------------------------------
def _tensor(config, shape) -> list[MinimumTerm]:
    tp = _degree(config, "tp")
    if tp == 1:
        return []
    m, layers = shape.micro_batches, _layers(shape)
    act = _tokens(config, shape) * _text_config(shape).hidden_size * _act_bytes(config, shape)
    recompute = getattr(config, "activation_checkpointing", "none") == "full"
    matched = shape.plan.matches(shape.model) if shape.plan is not None and shape.model is not None else {}
    # the ends, where the plan shards them: a vocabulary-parallel embedding's output, the head's input gradient
    embedding = _holds(shape, "pre") and matched.get(shape.plan.embedding) in ("embedding_rowwise",
                                                                                "vocab_parallel_embedding")
    head = shape.holds_head and (shape.plan is None or shape.plan.lm_head in matched)
    ends = int(embedding) + int(head)
    chunk = layout_facts(config).loss_chunk
    if chunk:  # the chunked loss: vocabulary-parallel, max then (sum of exps, target logit) per chunk
        calls = 2 * m * -(-_tokens(config, shape) // chunk)
        loss = [MinimumTerm("tp", "all_reduce", calls, 3 * m * _tokens(config, shape) * 4,
                            "vocabulary-parallel loss: 3 fp32 values per token (max, sum of exps, target logit)")
                ] if head else []
    elif getattr(config, "loss_parallel", False):  # vocabulary-parallel cross-entropy: max, target logit, sum of exps
        loss = [MinimumTerm("tp", "all_reduce", 3 * m, 3 * m * _tokens(config, shape) * 4,
                            "vocabulary-parallel loss: 3 per micro-batch of b·s fp32 values")] if head else []
    else:  # the loss needs every logit: gathered over the vocabulary
        vocab = getattr(_text_config(shape), "vocab_size", 0)
        loss = [MinimumTerm("tp", "all_gather", m, m * _tokens(config, shape) * vocab * _act_bytes(config, shape),
                            "the logits, b·s·V per micro-batch, gathered for the loss (loss_parallel keeps them "
                            "sharded)")] if head else []
    if getattr(config, "sequence_parallel", False):
        per_layer = 2 + (1 if recompute else 0)  # of each kind, forward + backward (+ the recomputed forward)
        gathers = m * (2 * per_layer * layers + int(_holds(shape, "pre")) + int(head))
        scatters = m * (2 * per_layer * layers + ends)
        rec = " + 1 recomputed" if recompute else ""
        return [MinimumTerm("tp", "all_gather", gathers, gathers * act,
                            f"per micro-batch: 2 forward + 2 backward{rec} per layer ({layers}) + 1 per end held "
                            "(the embedding's backward, the head's input), each the whole b·s·h"),
                MinimumTerm("tp", "reduce_scatter", scatters, scatters * act,
                            f"per micro-batch: 2 forward + 2 backward{rec} per layer + 1 per sharded end held "
                            f"({ends}: a vocabulary-parallel embedding's output, the head's input gradient)"),
                *loss]
    per_layer = 4 + (2 if recompute else 0)
    reduces = m * (per_layer * layers + ends)
    return [MinimumTerm("tp", "all_reduce", reduces, reduces * act,
                        f"per micro-batch: {per_layer} per layer ({layers}; 2 forward, 2 backward"
                        f"{', 2 recomputed' if recompute else ''}) + 1 per sharded end held ({ends}: a "
                        "vocabulary-parallel embedding's output, the head's input gradient), each b·s·h"),
            *loss]


# ---- pipeline: each micro-batch crosses each stage boundary forward and back ------------------------------------
def _pipeline(config, shape) -> list[MinimumTerm]:
    p = _degree(config, "pp")
    if p == 1:
        return []
    schedule = getattr(config, "pp_schedule", "1f1b")
    rank = shape.coords.get("pp")
    ranks = [rank] if rank is not None else range(p)
    ends = max(_boundary_ends(config, schedule, p, r) for r in ranks)
    act = _tokens(config, shape) * _text_config(shape).hidden_size * _act_bytes(config, shape)
    if getattr(config, "sequence_parallel", False):
        act /= _degree(config, "tp")  # each tensor-parallel rank sends its slice of the sequence
    calls = 2 * ends * shape.micro_batches
    return [MinimumTerm("pp", "p2p", calls, calls * act,
                        f"per micro-batch and stage boundary this rank holds ({ends}): the activation sent forward "
                        "and its gradient back, b·s·h each (÷tp with sequence parallel), counted at both ends")]


def _boundary_ends(config, schedule: str, p: int, rank: int) -> int:
    if schedule in V_SHAPED:
        stages, total = [rank, 2 * p - 1 - rank], 2 * p
    else:
        v = int(getattr(config, "pp_virtual_stages", 1) or 1) if schedule not in ("gpipe", "1f1b") else 1
        stages, total = [rank + k * p for k in range(v)], p * v
    owner = {s: s % p if schedule not in V_SHAPED else (s if s < p else 2 * p - 1 - s) for s in range(total)}
    return sum((s > 0 and owner[s - 1] != rank) + (s < total - 1 and owner[s + 1] != rank) for s in stages)


# ---- context parallel: the ring passes keys and values; Ulysses exchanges heads ---------------------------------
def _context(config, shape) -> list[MinimumTerm]:
    cp = _degree(config, "cp")
    if cp == 1:
        return []
    text = _text_config(shape)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    tp = _degree(config, "tp")
    m, layers = shape.micro_batches, _layers(shape)
    width = _act_bytes(config, shape) * _tokens(config, shape) * head_dim
    recompute = getattr(config, "activation_checkpointing", "none") == "full"
    if getattr(config, "cp_method", "ring") == "ring":
        chunk = 2 * kv / tp * width  # this rank's keys and values
        passes = 3 + (1 if recompute else 0)  # forward k/v, backward k/v and dk/dv (+ the recomputed forward)
        calls = 2 * passes * (cp - 1) * layers * m
        again = " (+ the recomputed forward)" if recompute else ""
        return [MinimumTerm("cp", "p2p", calls, calls * chunk,
                            f"per layer and micro-batch: keys and values passed cp-1 times forward, and keys, values "
                            f"and their gradients cp-1 times each backward{again}; each of b·(s/cp)·2·h_kv·d, "
                            "counted at both ends")]
    per_layer = 2 * (2 * heads + 2 * kv) / tp * width  # q, k, v and the output, forward and backward
    calls = 8 * layers * m
    extra = (4 * layers * m, (2 * heads + 2 * kv) / tp * width * layers * m) if recompute else (0, 0)
    return [MinimumTerm("cp", "all_to_all", calls + extra[0], per_layer * layers * m + extra[1],
                        "per layer and micro-batch: q, k, v and the output exchanged forward and their gradients "
                        "backward, each the rank's b·(s/cp)·heads·d")]


# ---- expert parallel: dispatch and combine --------------------------------------------------------------------
def _experts(config, shape) -> list[MinimumTerm]:
    ep = _degree(config, "ep")
    if ep == 1:
        return []
    moe_layers = {r.layer for r in shape.inventory if r.view and r.layer is not None}
    if not moe_layers:
        return []
    text = _text_config(shape)
    top_k = experts_per_token(text)
    # the ranks holding the same tokens (tensor parallel) each route a slice of them
    tokens = -(-_tokens(config, shape) // _degree(config, "tp"))
    one = tokens * top_k * text.hidden_size * _act_bytes(config, shape)
    recompute = getattr(config, "activation_checkpointing", "none") != "none"
    passes = 4 + (2 if recompute else 0)
    calls = passes * len(moe_layers) * shape.micro_batches
    return [MinimumTerm("ep", "all_to_all", calls, calls * one,
                        f"per MoE layer ({len(moe_layers)}) and micro-batch: dispatch and combine, forward and "
                        f"backward{' and recomputed' if recompute else ''}, each the rank's tokens × top-k "
                        f"({top_k}) × h")]


# ---- data parallel: the gradients reduced and the weights gathered -----------------------------------------------
def _data(config, shape) -> list[MinimumTerm]:
    from .parallel_dims import ParallelDims

    dims = ParallelDims(config)
    out = []
    by_view: dict[str, list] = {}
    for r in shape.inventory:
        by_view.setdefault(r.view or "", []).append(r)
    for view, records in by_view.items():
        axes = [a for a in (dims.grad_axes if not view else dims.view_grad_axes(view)) if dims.degree(a) > 1]
        if axes:
            out.extend(_data_terms(config, shape, dims, records, axes))
    return out


def _data_terms(config, shape, dims, records, axes: list[str]) -> list[MinimumTerm]:
    zero = int(getattr(config, "zero_stage", 0))
    m, pp = shape.micro_batches, _degree(config, "pp")
    weight = 2 if getattr(config, "mixed_precision", "no") == "bf16" else 4
    grads = 4 * sum(r.local_numel for r in records if r.trainable)  # reduced in fp32
    trained = weight * sum(r.local_numel for r in records if r.trainable)
    every = weight * sum(r.local_numel for r in records)
    shard = next((a for a in ("dp_shard", "efsdp") if a in axes), None) if zero >= 1 else None
    rest = [a for a in axes if a != shard]
    out = []
    if shard is None:
        name = "+".join(rest)
        return [MinimumTerm(name, "all_reduce", 1, grads, "the gradients, Ψg, once per step")]
    n = dims.degree(shard)
    # ZeRO-1 keeps whole gradients; a pipeline's stages keep them for the step; grad_sync says it where it is set
    sync = getattr(config, "grad_sync", "auto")
    per_step = sync == "step" if sync != "auto" else zero == 1 or pp > 1
    reductions = 1 if per_step else m
    out.append(MinimumTerm(shard, "reduce_scatter", reductions, reductions * grads,
                           "the gradients, Ψg, " + ("once per step" if reductions == 1 else
                                                    "every micro-batch (they accumulate sharded)")))
    if zero == 3 and not per_step:
        out.append(MinimumTerm(shard, "all_gather", 2 * m, 2 * m * every,
                               "every weight, Ψw, for each forward and each backward of every micro-batch"))
    elif zero == 3:
        out.append(MinimumTerm(shard, "all_gather", 1, every, "every weight, Ψw, once per step (kept gathered "
                               "across the step's micro-batches)"))
    else:
        out.append(MinimumTerm(shard, "all_gather", 1, trained, "the updated weights, Ψw of the trained ones, once "
                               "per step"))
    if rest:
        out.append(MinimumTerm("+".join(rest), "all_reduce", reductions, reductions * math.ceil(grads / n),
                               "each reduce-scatter's shard of the gradients, Ψg/dp_shard, over the replicas"))
    return out

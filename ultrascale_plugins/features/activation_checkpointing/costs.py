"""Activation memory: what autograd keeps for backward per token and layer (Korthikanti et al. 2022's tensors with
flash-style attention), divided by TP and SP, reduced by recomputation, times the micro-batches the schedule holds
in flight, plus the loss's logits on the rank that holds the head (checked against what autograd saves on the CPU:
tests/test_estimates.py). With a frozen base (PEFT adapters) some tensors are not kept and the adapters keep a few
of their own (``adapter_bytes``, checked the same way), and the backward is cheaper, so recomputing the forward
costs a larger share of the step."""
from __future__ import annotations

from ...interface.estimates import SIXTEEN_BIT_PROFILES, Estimate, flops_per_token, merge_flops
from ...interface.facts import layout_facts
from ...interface.moe_config import expert_share, experts_per_token


def activation_bytes_per_token(mc, config, mode: str, element: int,
                               profile: str = "ultrascale") -> tuple[float, float, float, float]:
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
    # the two norms' inputs (the residual stream) are split by SP; their outputs feed the column-parallel matmuls.
    # torch's TP styles keep that input whole (all-gathered under SP) for the weight gradient, so TP never divides
    # it; nanotron keeps the sequence shard and gathers it again in the backward (its tp_recompute_allgather,
    # on by default), so there SP divides it too
    sp_only, whole = 3 * h, 1 * h
    if profile == "nanotron":
        sp_only, whole = 4 * h, 0
    elif element == 2 and profile == "ultrascale":
        # under bf16 autocast each norm keeps an fp32 copy of its input and its bf16 normalized tensor (its weight's
        # gradient), sequence shards under SP, and each norm's output, all-gathered under SP, is kept whole by the
        # column-parallel matmuls it feeds: two whole, not one (the dry run's saved tensors, 70B under TP 8 + SP)
        sp_only, whole = 2 * h + 2 * 4 * h / element, 2 * h
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
        k = experts_per_token(mc)
        shared = getattr(mc, "n_shared_experts", 0) or 0
        return moe * (k + shared)
    if expert_share(mc) < 1:
        k = experts_per_token(mc)
        return dense * k
    return dense


def activation_terms(config, shape, est: Estimate) -> None:
    """Activations saved for backward on this rank: its layers x the micro-batches its schedule holds in flight,
    divided by TP (and SP), plus the loss's logits on the rank that holds the head."""
    mc = shape.model_config
    element = shape.activation_bytes(config)
    mode = config.activation_checkpointing
    facts = layout_facts(config)
    tp = facts.degree("tp")
    tp_part, sp_part, whole, working = activation_bytes_per_token(mc, config, mode, element, shape.profile)
    sp_div = tp if facts.sequence_sharded else 1
    per_token = tp_part / tp + sp_part / sp_div + whole
    tokens = shape.tokens_per_micro_batch
    layers = shape.layers_here if shape.layers_here is not None else mc.num_hidden_layers
    saved = per_token * tokens * layers * shape.in_flight
    if facts.activations_offloaded and shape.profile == "ultrascale" and layers > 1:
        # activation offload: each layer's saved tensors go to the host as its forward makes them and come back
        # for its backward; the device holds the layer at work and the one whose copy is in flight
        moved = per_token * tokens * max(0.0, layers * shape.in_flight - 2)
        saved -= moved
        est.host_bytes += moved
        est.factors["host_copy_bytes"] = (est.factors.get("host_copy_bytes", 0.0)
                                          + 2 * per_token * tokens * layers * shape.micro_batches)
    held, transient, head_trains = adapter_bytes(shape, element, mode, sp_div, max(1, layers))
    saved += held * shape.in_flight + transient
    if mode != "none":
        est.factors["recompute_flops"] = recompute_factor(shape, mode)
    extra = merge_flops(shape.inventory) * (4 / 3 if mode == "full" else 1)  # the merge's forward, recomputed
    if extra:
        est.factors["extra_flops"] = est.factors.get("extra_flops", 0.0) + extra
    logits = 0.0
    if shape.holds_head:
        if shape.profile in SIXTEEN_BIT_PROFILES:
            # nanotron's and Megatron's vocabulary-parallel loss: the fp32 copy of the logits (Megatron's pipeline
            # keeps it as the last stage's output until the backward) and, made from it, the shifted exponentials
            # kept as the softmax (the 16-bit logits are freed at the copy); the final norm's and the head's inputs
            # (sequence shards under nanotron's tp_recompute_allgather and Megatron's sequence parallel)
            logits = 8 * mc.vocab_size * tokens / tp + 2 * element * mc.hidden_size * tokens / sp_div
        elif facts.loss_chunk:
            # the chunked loss (features.chunked_loss) in its backward: one chunk's fp32 logits and their
            # exponentials (in a low-precision compute dtype, the chunk's gradient in that dtype too); the fp32
            # log-sum-exp of every token; the head's weight gradient, accumulated in fp32 from the first chunk on
            # (in a low-precision dtype, each chunk's product beside it); the head's input, kept for the recomputation
            rows = mc.vocab_size / shape.head_split(config)
            chunk = min(facts.loss_chunk, tokens)
            logits = (8 + (element if element < 4 else 0)) * rows * chunk + 4 * tokens
            if head_trains:
                logits += (4 + (element if element < 4 else 0)) * rows * mc.hidden_size
            saved += element * mc.hidden_size * tokens
        else:
            vocab_div = tp if facts.vocab_sharded_loss else 1
            # at the start of the loss's backward (the peak of a step): the fp32 log-probabilities the loss keeps,
            # their gradient and the gradient of the fp32 logits (the logits themselves are freed once the loss is
            # computed: the step keeps only the loss, Runtime.train_step); the head's input, kept for its weight
            # gradient (not when the head is frozen)
            logits = 12 * mc.vocab_size * tokens / vocab_div
            if facts.degree("pp") > 1:  # torch's pipeline stage keeps its output, the logits, until the stage's backward
                logits += element * mc.vocab_size * tokens / vocab_div
            if head_trains:
                saved += element * mc.hidden_size * tokens
    # full recomputation re-runs one layer at a time inside the backward, after the loss's tensors are freed: its
    # working set and the loss's are not alive together
    est.add_memory("activations", saved + max(logits, working / tp * tokens if mode != "none" else 0.0))
    if shape.profile == "nanotron" and tp > 1:
        # nanotron's two all-gather buffers (MemoryBuffer "allgather"/"allgather2"), a gathered micro-batch each in
        # the compute dtype, kept for the whole run
        est.add_memory("other", 2 * element * mc.hidden_size * tokens)


def recompute_factor(shape, mode: str) -> float:
    """Compute multiplier of recomputation: full recomputes the forward, 1 + F/(F + B) (4/3 when every weight
    trains, as B = 2F; more with a frozen base, whose backward is cheaper); selective recomputes the attention core,
    3 % of a step that trains every weight, the same FLOPs on a cheaper step otherwise."""
    fwd, bwd = flops_per_token(shape.inventory, shape.model_config, shape.seq_len, layers=shape.layers_here)
    ratio = bwd / fwd if fwd else 2.0
    if mode == "full":
        return 1 + 1 / (1 + ratio)
    return 1 + 0.03 * (3 / (1 + ratio))


def adapter_bytes(shape, element: int, mode: str, sp_div: int, layers: int) -> tuple[float, float, bool]:
    """What a frozen base and PEFT's adapters change in this rank's activations: (bytes per micro-batch in flight,
    bytes held once, whether the head trains). A frozen norm's weight keeps no copy of the normalized tensor it
    scales (-e·h per token; kept only without recomputation); each LoRA factor A keeps its r-wide output for B's
    gradient (+e·r per token, or one layer's worth under full recomputation); a merged adapter (PEFT's
    ParamWrapper: the fused experts) keeps each layer's merged weight W + B·A for the backward (one layer at a time
    under full recomputation), and the backward holds one layer's gradient of it."""
    mc = shape.model_config
    h = mc.hidden_size
    records = shape.inventory
    tokens = shape.tokens_per_micro_batch
    held = transient = 0.0
    if mode == "none":
        norms = sum(1 for r in records if r.part == "layer" and not r.trainable and len(r.shape) == 1
                    and r.shape[0] == h and r.name.endswith("weight"))
        held -= element * h / sp_div * norms * tokens
    lora_out = sum(r.rank * r.active for r in records if r.adapter in ("lora_A", "lora_embedding_A") and not r.merged)
    if mode == "full":
        transient += element * lora_out / layers * tokens
    else:
        held += element * lora_out * tokens
    size = {r.name: r.local_numel for r in records}
    merged = element * sum(size.get(b, 0) for b in {r.adapter_of for r in records if r.merged})
    if merged:
        transient += merged / layers  # a layer's gradient of its merged weight
        if mode == "full":
            transient += merged / layers
        else:
            held += merged
    heads = [r for r in records if (r.part == "post" and len(r.shape) == 2 and not r.adapter) or r.tied_head]
    names = {r.name for r in heads}
    head_trains = not heads or any(r.trainable for r in heads) or any(r.adapter_of in names for r in records)
    return held, transient, head_trains


"""Context parallel: the sequence itself split over the ``cp`` mesh axis, ring attention or Ulysses.

Built only on the public hooks, as a third-party dimension would be:

- fields ``cp`` and ``cp_method`` (``ultrascale_declare_fields``); a mesh axis ``cp`` whose ranks hold different tokens
  of the same rows, so gradients are averaged and valid tokens counted over it (``ultrascale_declare_mesh_axes``);
- checks before any process group (``ultrascale_validate_config`` / ``ultrascale_validate_model``): a meta-device
  run of the model with a probe in place of attention shows that every decoder layer's attention goes through
  transformers' ``AttentionInterface``, with what arguments, and that nothing else would see a split sequence;
- the transform (stage ``cp``, after tensor parallel): the model's config selects this rank's
  ring / Ulysses attention function, registered in ``AttentionInterface``;
- every step (``ultrascale_step_shard_batch``): the head-tail split of token ids, targets, global positions and the
  padding mask (``cp_layout``);
- costs (``ultrascale_cost_estimate``): the other dimensions' per-rank terms for ``seq_len / cp`` tokens, plus the
  key/value traffic of the ring or the all-to-alls.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from ...interface.config import ConfigError
from ...interface.hookspecs import hookimpl
from ...interface.stages import Stage, step
from ...interface.facts import layout_facts
from ...interface.mesh_axes import MeshAxis
from . import layout as cp_layout
from .attention import REFUSED_KWARGS, CPState, cp_attention, kv_replication, unsupported_kwargs

KERNELS = ("auto", "portable")
METHODS = ("ring", "ulysses")
_names = itertools.count(1)


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("cp", int, 1, "context-parallel degree: the sequence of every row is split over cp ranks", minimum=1,
               ask="Context-parallel degree, splitting each sequence")
    fields.add("cp_method", str, "ring", "ring: keys/values travel round the cp ranks (any head count); ulysses: "
               "all-to-all from sequence shards to head shards around attention", choices=METHODS,
               ask="Context-parallel method", ask_when=lambda said: said.get("cp", 1) > 1)
    fields.add("cp_kernel", str, "auto", "auto: each block of attention by PyTorch's SDPA kernels (flash on CPU; "
               "flash, memory-efficient or cuDNN on CUDA); portable: matmul + softmax in fp32", choices=KERNELS)


@hookimpl
def ultrascale_declare_mesh_axes(config):
    return [MeshAxis("cp", config.cp, after="dp_shard", reduces_grads=True, counts_tokens=True,
                     words=f"({config.cp_method})", says="cp_method")]


def _heads(model_config):
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    return heads, kv


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    if config.cp == 1 or model_config is None:
        return
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        value = getattr(text, name, 0) or 0
        if isinstance(value, (int, float)) and value > 0:
            raise ConfigError(f"cp={config.cp}: the model's {name}={value} — attention dropout is not available with "
                              f"context parallel. Fix: set {name}: 0 in the model config, or cp: 1")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in ("dynamic", "longrope"):
        raise ConfigError(f"cp={config.cp}: rope_type '{rope_type}' rescales by the longest position a rank sees, "
                          "which differs between the sequence shards. Fix: use a static rotary type, or cp: 1")
    heads, kv = _heads(model_config)
    if config.cp_method == "ulysses" and heads:
        tp = layout_facts(config).degree("tp")
        kv_replication(heads // tp, max(kv // tp, 1), config.cp)


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if config.cp == 1:
        return
    probe_attention(plan.causal_lm(model) if plan is not None else model, config.cp)


@hookimpl
def ultrascale_transform_stages(config, model_config):
    # after tensor parallel: attention then runs on this rank's heads
    return [Stage("cp", attend_across_ranks, after=("tp",), axes=("cp",), active=config.cp > 1,
                  does=f"the sequence split over {config.cp} ranks, attention {config.cp_method} across them")]


def attend_across_ranks(model, ctx):
    if ctx.config.cp == 1:
        return
    from transformers import AttentionInterface

    state = ctx.plugin_state.get("cp")
    if state is None:
        group = ctx.dims.group("cp")
        state = CPState(group, ctx.dims.degree("cp"), ctx.sub_mesh("cp").get_local_rank(), ctx.config.cp_method,
                        kernel=ctx.config.cp_kernel)
        ctx.plugin_state["cp"] = state
        name = f"ultrascale_cp_{state.method}_{next(_names)}"  # one per model: its own group and batch flag
        AttentionInterface.register(name, lambda *args, **kwargs: cp_attention(state, *args, **kwargs))
        state.name = name
    model.config._attn_implementation = state.name  # the config's setter carries it to sub-configs


@hookimpl
@step("cp")
def ultrascale_step_shard_batch(batch, ctx):
    state = ctx.plugin_state.get("cp")
    if state is None:
        return
    state.document_mask = cp_layout.shard_batch(batch, state.size, state.rank)


@hookimpl(specname="ultrascale_cost_estimate")
@step("cp_tokens", before="split")
def tokens_per_rank(config, model_config, shape, estimate):
    """First: every other dimension's per-rank terms are those of ``seq_len / cp`` tokens (the engine gives the
    shape its ``seq_len`` back after the chain)."""
    if config.cp > 1:
        shape.seq_len = -(-shape.seq_len // config.cp)


@hookimpl
@step("cp_exchanges", after="dp")
def ultrascale_cost_estimate(config, model_config, shape, estimate):
    """After data parallel (the gradient bytes it left): the attention exchanges (bytes
    handed to the collectives, sends and receives both counted for the ring's point-to-point transfers): the ring
    (``cp_attention``) passes each layer's keys and values one hop per step, cp - 1 hops in the forward, again in
    the backward (and in a recomputed forward), and their fp32 gradients cp hops home; Ulysses all-to-alls q, k, v
    and the output forward and their gradients backward. The parameters are whole on every cp rank, so the engine
    all-reduces their gradients over cp once per step (what is left of them after data parallel's sharding)."""
    if config.cp == 1:
        return
    heads, kv = _heads(model_config)
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    tokens = shape.tokens_per_micro_batch  # this rank's tokens of one micro-batch (``tokens_per_rank``)
    layers = shape["layers_here"] if shape["layers_here"] is not None else model_config.num_hidden_layers
    facts = layout_facts(config)
    width = shape.activation_bytes(config)
    tp = facts.degree("tp")
    recomputed = 1 if facts.recompute == "full" else 0  # the forward's exchanges once more
    if config.cp_method == "ring":
        block = 2 * kv * head_dim * tokens  # this rank's keys and values, concatenated: elements
        kv_hops = (config.cp - 1) * (2 + recomputed)
        sent = block * (width * kv_hops + 4 * config.cp)  # the gradients travel in fp32
        # each hop's transfer runs while the previous block is attended; a hop is one send and one receive
        estimate.add_comm("cp", 2 * sent * layers / tp, "p2p", calls=2 * (kv_hops + config.cp) * layers,
                          per="micro_batch", overlap=0.8)
    else:  # q, k, v and the output, each handed whole to an all-to-all, forward and backward
        per_layer = (2 + recomputed) * (2 * heads + 2 * kv) * head_dim * tokens * width
        estimate.add_comm("cp", per_layer * layers / tp, "all_to_all", calls=4 * (2 + recomputed) * layers,
                          per="micro_batch")
    grads = estimate.memory.get("grads", 0.0)
    if grads:
        estimate.add_comm("cp", grads, "all_reduce", calls=1, per="step")


@hookimpl
def ultrascale_cost_comm_minimum(config, shape):
    """The least communication context parallel's ``cp`` axis needs for a step (``minimum``)."""
    from .minimum import context_minimum

    return context_minimum(config, shape)


def _cp_layout(world, per_node, model_config):
    from ...interface.presets import largest_divisor

    cp = largest_divisor(world, per_node)
    return {"cp": cp, "cp_method": "ring", "dp_shard": world // cp}


@hookimpl
def ultrascale_declare_presets():
    from ...interface.presets import Preset

    return [Preset("cp", "context parallel (ring attention) within a node, ZeRO-3 across", _cp_layout)]


@hookimpl
def ultrascale_declare_accelerate_keys():
    # Accelerate's cp_size is its ring (torch) context parallel; sp_size its Ulysses sequence parallel
    return {"cp_size": ("cp", {}), "sp_size": ("cp", {"cp_method": "ulysses"})}


# ---- the check before any worker starts ---------------------------------------------------------------------
def probe_attention(model: nn.Module, cp: int) -> None:
    """Run ``model``'s architecture once on the meta device with a probe registered as its attention function;
    refuse (ConfigError) unless every decoder layer attends through the probe, causally, with the arguments
    context parallel implements, and no module mixes tokens along the sequence outside attention."""
    from transformers import AttentionInterface

    from ...models.dataflow import meta_twin

    arch = getattr(model.config, "model_type", type(model).__name__)
    # convolutions over the sequence (Mamba-style mixers carry one), recurrent cells, state-space blocks
    mixers = sorted({type(m).__name__ for m in model.modules()
                     if isinstance(m, (nn.Conv1d, nn.RNNBase))
                     or any(word in type(m).__name__.lower() for word in ("mamba", "rwkv"))})
    if mixers:
        what = ", ".join(mixers)
        raise ConfigError(f"cp={cp}: model type '{arch}' mixes tokens outside attention ({what}), which would see "
                          "only this rank's part of the sequence. Fix: cp: 1 for this model")
    calls: list = []

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append((module, query.shape, key.shape, attention_mask, kwargs))
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1],
                           dtype=query.dtype, device=query.device), None

    name = "ultrascale_cp_probe"
    AttentionInterface.register(name, probe)
    twin = meta_twin(model)
    twin.config._attn_implementation = name
    seq = 8
    try:
        with torch.no_grad():
            twin(input_ids=torch.zeros(2, seq, dtype=torch.long, device="meta"),
                 position_ids=torch.arange(seq, device="meta").expand(2, seq), use_cache=False)
    except Exception as exc:  # noqa: BLE001 - the model does not run with an attention function it did not choose
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise ConfigError(f"cp={cp}: model type '{arch}' does not run with a context-parallel attention function "
                          f"(tried on the meta device: {type(exc).__name__}: {first}). Fix: cp: 1 for this model") from exc
    layers = sum(1 for m in twin.modules() if type(m).__name__ in set(getattr(twin, "_no_split_modules", None) or []))
    problem = None
    if not calls:
        problem = "its attention does not go through transformers' AttentionInterface"
    elif layers and len(calls) < layers:
        problem = (f"only {len(calls)} of its {layers} decoder layers attend through transformers' "
                   "AttentionInterface; the others would see only this rank's part of the sequence")
    for module, q_shape, k_shape, mask, kwargs in calls:
        if problem:
            break
        if getattr(module, "is_causal", True) is False:
            problem = f"{type(module).__name__} is not causal"
        elif mask is not None:
            problem = f"{type(module).__name__} receives a mask the model builds itself"
        elif q_shape[2] != seq or k_shape[2] != seq:
            problem = f"{type(module).__name__} attends over {k_shape[2]} keys for {q_shape[2]} queries, not the sequence"
        elif kwargs.get("position_ids") is None or kwargs["position_ids"].shape[-1] != seq:
            problem = f"{type(module).__name__} does not pass the token positions to its attention"
        else:
            bad = unsupported_kwargs(kwargs)
            if bad:
                problem = (f"{type(module).__name__} passes {bad[0]} "
                           f"({REFUSED_KWARGS.get(bad[0], 'an unknown tensor')}) to its attention")
    if problem:
        raise ConfigError(f"cp={cp}: model type '{arch}': {problem}, which context parallel does not implement. "
                          "Fix: cp: 1 for this model")

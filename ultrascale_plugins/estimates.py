"""What one rank of a layout costs: memory by category, communication by mesh axis, and the factors that stretch
its compute (recomputation, the pipeline bubble). Formulas and sources: the project's reference notes (Ultra-Scale
Playbook; Korthikanti et al. 2022; Narayanan et al. 2021; PaLM appendix B).

Each dimension's plugin adds its own terms through ``ultrascale_estimate(config, model_config, shape,
estimate)``; ``engine.estimate`` and the planner (``planner.cost``) collect them. ``shape`` (a ``Shape``) says
what the estimate is for: the sequence, the micro-batch, the micro-batches per step, the implementation profile,
the optimizer, which rank (``coords``; an axis left out means "the most loaded rank along it"), and the
parameter ``inventory`` — every parameter of the model with the shape this rank holds of it, which the dimensions
cut in turn (pipeline: which stage; tensor parallel: which slice; data parallel: which shard), so parameter,
gradient and optimizer bytes come out exact for any model, uneven shards and tied weights included.
"""
from __future__ import annotations

import dataclasses
import math
import re

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

# Bytes per parameter by implementation profile and precision: (parameters, gradients, optimizer per element of
# Adam state). "ultrascale": this package (FSDP2/DDP keep fp32 weights and gradients; bf16 is a compute dtype).
# "nanotron": the Playbook's runs (bf16 weights and gradients, fp32 gradient accumulation buffer, fp32 master
# weights kept by the optimizer).
PROFILES = ("ultrascale", "nanotron")
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}  # fp32 state tensors per parameter


@dataclasses.dataclass
class CommTerm:
    """``nbytes`` moved per rank by ``calls`` collectives of one kind on one mesh axis, per ``per`` ("step" or
    "micro_batch"); ``overlap``: the fraction of its time that can hide behind compute (0 = fully exposed)."""

    axis: str
    nbytes: float
    collective: str = "all_reduce"
    calls: int = 1
    per: str = "step"
    overlap: float = 0.0


@dataclasses.dataclass
class Estimate:
    """Bytes per rank by memory category, communication terms per mesh axis, and factors:
    ``recompute_flops`` (compute multiplier of recomputation), ``bubble`` (pipeline idle time as a fraction of
    the busy time), and whatever a plugin adds."""

    memory: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(MEMORY_CATEGORIES, 0.0))
    terms: list = dataclasses.field(default_factory=list)
    factors: dict = dataclasses.field(default_factory=dict)
    exact: bool = True  # False when some parameter's share could only be approximated
    micro_batches: int = 1  # per optimizer step on this rank (engine.estimate sets it from the shape)

    def add_memory(self, category: str, nbytes: float) -> None:
        if category not in self.memory:
            raise ValueError(f"memory category {category!r}: one of {', '.join(MEMORY_CATEGORIES)}")
        self.memory[category] += float(nbytes)

    def add_comm(self, axis: str, nbytes: float, collective: str = "all_reduce", *, calls: int = 1,
                 per: str = "step", overlap: float = 0.0) -> None:
        if collective not in COLLECTIVES:
            raise ValueError(f"collective {collective!r}: one of {', '.join(COLLECTIVES)}")
        if per not in ("step", "micro_batch"):
            raise ValueError(f"per={per!r}: 'step' or 'micro_batch'")
        self.terms.append(CommTerm(axis, float(nbytes), collective, int(calls), per, float(overlap)))

    @property
    def comm(self) -> dict:
        """Bytes per rank per optimizer step, by mesh axis."""
        out: dict = {}
        for t in self.terms:
            n = t.nbytes * (self.micro_batches if t.per == "micro_batch" else 1)
            out[t.axis] = out.get(t.axis, 0.0) + n
        return out

    @property
    def total_memory(self) -> float:
        return sum(self.memory.values())


# ---- the parameter inventory --------------------------------------------------------------------------------
@dataclasses.dataclass
class ParamRecord:
    """One parameter (tied ones once). ``part``: "pre" (before the decoder layers: embeddings), "layer"
    (``layer`` is its index) or "post" (final norm, head). ``local``: the shape this rank holds, as the dimensions
    have cut it so far. ``tied_head``: the head uses this (embedding) weight too, so a pipeline's last stage holds a
    copy. ``active``: the share of it one token uses (MoE experts: top-k / experts)."""

    name: str
    shape: tuple
    part: str
    layer: int | None = None
    tied_head: bool = False
    active: float = 1.0
    trainable: bool = True
    local: tuple = ()

    def __post_init__(self):
        self.local = tuple(self.local or self.shape)

    def clone(self) -> "ParamRecord":
        twin = object.__new__(ParamRecord)
        twin.__dict__.update(self.__dict__)
        return twin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local)


def chunk_size(n: int, parts: int, index: int) -> int:
    """Rows of ``n`` that part ``index`` of ``parts`` holds when split as ``torch.chunk`` does (DTensor's Shard
    and FSDP2: ceil-sized chunks, the last ones smaller or empty)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


_INVENTORIES: dict = {}
_META_MODELS: dict = {}


def meta_model(model_config):
    """The causal LM of ``model_config`` on the meta device (no storage), cached by the config's content."""
    from .fields import ConfigError

    key = model_config.to_json_string(use_diff=False)
    if key not in _META_MODELS:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            try:
                _META_MODELS[key] = AutoModelForCausalLM.from_config(model_config)
            except ValueError as exc:
                raise ConfigError(f"model type '{model_config.model_type}' has no causal-LM class in transformers "
                                  f"({exc}). Fix: use a decoder-only causal LM") from None
    return _META_MODELS[key]


def inventory(model, plan=None) -> list[ParamRecord]:
    """Fresh records of ``model``'s parameters (built once per model and plan; the dimensions cut the copies)."""
    key = (id(model), None if plan is None else tuple(plan.layers))
    if key not in _INVENTORIES or _INVENTORIES[key][0] is not model:
        _INVENTORIES[key] = (model, _build_inventory(model, plan))
    return [r.clone() for r in _INVENTORIES[key][1]]


def _build_inventory(model, plan=None) -> list[ParamRecord]:
    """Every parameter of ``model`` (real or on the meta device) as a ``ParamRecord``: before, in or after the
    decoder layers, and the MoE active share. (Tensor parallel fills in the dims it shards from ``plan``.)"""
    layers, before = _layer_list(model, plan)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    active = _expert_share(model.config)
    records = []
    for name, param in model.named_parameters():
        layer = None
        m = re.match(re.escape(layers) + r"\.(\d+)\.", name) if layers else None
        if m:
            part, layer = "layer", int(m.group(1))
        elif any(name.startswith(p + ".") for p in before):
            part = "pre"
        else:
            part = "post"
        is_expert = ".experts." in name or name.endswith(".experts")
        records.append(ParamRecord(name, tuple(param.shape), part, layer,
                                   tied_head=bool(tied and param is embed.weight),
                                   active=active if is_expert else 1.0, trainable=param.requires_grad))
    return records


def _layer_list(model, plan) -> tuple[str | None, list[str]]:
    """(FQN of the decoder layers' ModuleList, FQNs of the modules that run before it): the plan's layers, else
    the ModuleList holding most parameters; "before" are the siblings registered ahead of it (embeddings)."""
    from torch import nn

    fqn = None
    if plan is not None and plan.layers:
        fqn = plan.layers[0].rpartition(".")[0]
    else:
        lists = [(f, m) for f, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if lists:
            fqn = max(lists, key=lambda x: sum(p.numel() for p in x[1].parameters()))[0]
    if not fqn:
        return None, []
    parent_fqn, _, leaf = fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    before = []
    for name, _ in parent.named_children():
        if name == leaf:
            break
        before.append(f"{parent_fqn}.{name}" if parent_fqn else name)
    return fqn, before


def _expert_share(mc) -> float:
    """top-k / experts of a mixture-of-experts config (1 for a dense model)."""
    experts = next((getattr(mc, k) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
                    if isinstance(getattr(mc, k, None), int) and getattr(mc, k) > 0), None)
    top_k = next((getattr(mc, k) for k in ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")
                  if isinstance(getattr(mc, k, None), int) and getattr(mc, k) > 0), None)
    return min(1.0, top_k / experts) if experts and top_k else 1.0


# ---- the built-in dimensions' terms (called from their plugins' ultrascale_estimate) --------------------------
def parameter_count(mc) -> int:
    """Llama-style decoder parameter count from a Hugging Face config (the formulas' closed form; the planner
    counts the real parameters of any architecture through ``inventory``)."""
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


def precision_bytes(config, profile: str) -> tuple[int, int, int]:
    """(bytes per parameter element, per gradient element, per optimizer-state element beyond Adam's moments:
    the fp32 master copy) for this layout's precision and profile."""
    if profile == "nanotron":
        return 2, 2 + 4, 4  # bf16 weights; bf16 grads + fp32 accumulation buffer; fp32 master weights
    return 4, 4, 0  # this package keeps fp32 weights and gradients (bf16 is the compute dtype only)


def data_parallel_terms(config, shape, est: Estimate) -> None:
    """Parameter, gradient and optimizer bytes of this rank's (already pipeline- and TP-cut) parameters, sharded
    as ZeRO says; the data-parallel collectives per step."""
    dp_shard, dp_rep = config.dp_shard, config.dp_replicate
    dp = dp_shard * dp_rep
    zero = config.zero_stage
    profile = shape.profile
    pbytes, gbytes, master = precision_bytes(config, profile)
    states = OPTIMIZERS[shape.optimizer]
    records = [r for r in shape.inventory if r.local_numel or r.numel]
    coords = shape.coords
    if zero >= 2:
        # FSDP2 shards dim 0 of every (TP-local) parameter over dp_shard, torch.chunk-style; HSDP replicates over
        # dp_replicate. The most loaded rank is shard 0.
        s = coords.get("dp_shard", 0)
        local = []
        for r in records:
            rows = chunk_size(r.local[0], dp_shard, s) if r.local else 0
            local.append((r, rows * math.prod(r.local[1:])))
    else:
        local = [(r, r.local_numel) for r in records]
    held = sum(n for _, n in local)
    trainable = [(r, n) for r, n in local if r.trainable]
    # Optimizer states: over the shards above (ZeRO-2/3), or ZeRO-1's partition of whole parameters.
    if zero == 1 and dp > 1 and profile == "ultrascale":
        opt_numel, opt_tensors = _zero1_share(trainable, dp, coords, dp_shard)
    elif zero == 1 and dp > 1:
        opt_numel, opt_tensors = sum(n for _, n in trainable) / dp, len(trainable) / dp
    else:
        opt_numel, opt_tensors = sum(n for _, n in trainable), len(trainable)
    est.add_memory("params", pbytes * held)
    est.add_memory("grads", gbytes * sum(n for _, n in trainable))
    step_counters = 4 * opt_tensors if shape.optimizer in ("adam", "adamw") else 0  # Adam's 0-d fp32 step
    est.add_memory("optimizer", (4 * states + master) * opt_numel + step_counters)
    if profile == "ultrascale":
        full = sum(r.local_numel for r in records)
        per_layer = full / max(1, len({r.layer for r in records if r.layer is not None}))
        compute = 2 if config.mixed_precision == "bf16" else 4
        if zero >= 2 and dp_shard > 1:
            # FSDP2 gathers whole weights in the compute dtype for one layer plus the next (prefetched) under
            # ZeRO-3, all of them under ZeRO-2; a layer's whole fp32 gradient waits for its reduce-scatter
            est.add_memory("other", compute * (2 * per_layer if zero == 3 else full) + 4 * per_layer)
        elif compute == 2:  # DDP under autocast caches a bf16 copy of every weight during the forward
            est.add_memory("other", 2 * full)
    if dp <= 1:
        return
    full_local = sum(r.local_numel for r in records if r.trainable)
    if profile == "ultrascale" and zero <= 1 and config.pp == 1:
        est.add_memory("other", 4 * full_local)  # DDP's gradient buckets: a flat fp32 copy of every gradient
    grad_wire = 4  # both profiles reduce gradients in fp32 (FSDP2's reduce_dtype; nanotron's fp32 accumulator)
    weight_wire = 2 if (config.mixed_precision == "bf16" or profile == "nanotron") else 4
    axes = [a for a, d in (("dp_replicate", dp_rep), ("dp_shard", dp_shard)) if d > 1]
    if zero >= 2:
        # reduce-scatter of the gradients once per step (accumulated without sync); all-gathers of the weights
        # before each forward and (ZeRO-3) each backward of every micro-batch, prefetched behind compute
        gathers = 2 if zero == 3 and config.pp == 1 else 1
        est.add_comm("dp_shard", grad_wire * full_local, "reduce_scatter", calls=_n_layers(records) + 1,
                     overlap=shape.dp_overlap)
        per = "micro_batch" if config.pp == 1 else "step"
        est.add_comm("dp_shard", gathers * weight_wire * full_local, "all_gather",
                     calls=gathers * (_n_layers(records) + 1), per=per, overlap=shape.gather_overlap)
        if dp_rep > 1:
            est.add_comm("dp_replicate", grad_wire * full_local / dp_shard, "all_reduce", overlap=shape.dp_overlap)
        return
    for axis in axes:  # DDP's all-reduce (ZeRO-1: reduce-scatter + all-gather, the same volume)
        share = (dp_rep if axis == "dp_replicate" else dp_shard) / dp
        if zero == 1:
            est.add_comm(axis, grad_wire * full_local * share, "reduce_scatter", overlap=shape.dp_overlap)
            est.add_comm(axis, weight_wire * full_local * share, "all_gather")
        else:
            est.add_comm(axis, grad_wire * full_local * share, "all_reduce", calls=max(1, _n_layers(records)),
                         overlap=shape.dp_overlap)


def _n_layers(records) -> int:
    return len({r.layer for r in records if r.layer is not None})


def _zero1_share(trainable, dp: int, coords, dp_shard: int) -> tuple[float, float]:
    """ZeRO-1 as ``torch.distributed.optim.ZeroRedundancyOptimizer`` partitions: parameters by size, largest
    first, each to the rank holding the fewest elements so far. (elements, tensors) of one rank: ``coords``'
    data-parallel rank, else the most loaded."""
    sizes, counts = [0] * dp, [0] * dp
    for n in sorted((n for _, n in trainable), reverse=True):
        k = sizes.index(min(sizes))
        sizes[k] += n
        counts[k] += 1
    if "dp_shard" in coords or "dp_replicate" in coords:  # the flattened (dp_replicate, dp_shard) group rank
        k = coords.get("dp_replicate", 0) * dp_shard + coords.get("dp_shard", 0)
        return sizes[k], counts[k]
    k = sizes.index(max(sizes))
    return sizes[k], counts[k]


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
    if moe and _expert_share(mc) < 1:
        k = next((getattr(mc, a) for a in ("num_experts_per_tok", "moe_top_k", "top_k") if getattr(mc, a, None)), 1)
        shared = getattr(mc, "n_shared_experts", 0) or 0
        return moe * (k + shared)
    if _expert_share(mc) < 1:
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


@dataclasses.dataclass
class Shape:
    """What an estimate is for. ``coords``: mesh-axis index of the rank (an axis left out: the most loaded rank
    along it). ``inventory``: the model's parameters (``inventory()``), cut by the dimensions as the estimate
    runs. ``layers_here``/``in_flight``/``holds_head``: set by the pipeline (the rank's decoder layers, the
    micro-batches it holds activations of, whether it runs the loss)."""

    model_config: object
    seq_len: int = 2048
    micro_batch: int = 1
    micro_batches: int = 1  # per optimizer step on this rank (gradient accumulation or pipeline micro-batches)
    profile: str = "ultrascale"
    optimizer: str = "adamw"
    coords: dict = dataclasses.field(default_factory=dict)
    inventory: list = dataclasses.field(default_factory=list)
    layers_here: int | None = None
    in_flight: float = 1.0
    holds_head: bool = True
    model: object = None  # the model (real or on the meta device) the inventory was read from
    plan: object = None  # the model plan (``models.plan.ModelPlan``) the layout runs with, if any
    dp_overlap: float = 0.0  # fraction of gradient reduction hidden behind backward (planner constant)
    gather_overlap: float = 0.0  # fraction of ZeRO-3 weight gathers hidden behind compute (planner constant)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    def activation_bytes(self, config) -> int:
        return 2 if (config.mixed_precision == "bf16" or self.profile == "nanotron") else 4

    # dict-style access for plugins written against the first interface (shape["seq_len"])
    def __getitem__(self, key):
        return getattr(self, key)

    def __setitem__(self, key, value):
        setattr(self, key, value)

"""What one rank of a layout costs: memory by category, communication by mesh axis, and the factors that stretch
its compute (recomputation, the pipeline bubble). Formulas and sources: the project's reference notes (Ultra-Scale
Playbook; Korthikanti et al. 2022; Narayanan et al. 2021; PaLM appendix B).

Each dimension's plugin adds its own terms through ``ultrascale_cost_estimate(config, model_config, shape,
estimate)``; ``engine.estimate`` and the planner (``planner.cost``) collect them. ``shape`` (a ``Shape``) says
what the estimate is for: the sequence, the micro-batch, the micro-batches per step, the implementation profile,
the optimizer, which rank (``coords``; an axis left out means "the most loaded rank along it"), and the
parameter ``inventory`` — every parameter of the model with the shape this rank holds of it, which the dimensions
cut in turn (pipeline: which stage; tensor parallel: which slice; data parallel: which shard), so parameter,
gradient and optimizer bytes come out exact for any model, uneven shards and tied weights included. Each record
says whether it trains: a PEFT model's frozen base does not (its adapters do), and ``Shape.adapters`` (an
``Adapters``: LoRA as PEFT would add it) prices a model that has no adapters yet as if it had them — the planner's
``--peft lora`` — with the same records a real PEFT model gives, so every dimension costs both alike.

This module holds the ledger's types, which every dimension shares (the ``Estimate``, the ``Shape``, the
inventory, the adapters asked for and their factors); the knowledge behind the terms lives with its owner: what
LoRA adds, ``features/peft/pricing.py`` (PEFT's ``WrapperLibrary.adapter_factors``); a mixture of experts' config
keys, ``interface/moe_config.py``; each built-in dimension's own terms: ``dims/pipeline/costs.py``, ``dims/tensor/costs.py``,
``dims/data_parallel/costs.py``, ``features/activation_checkpointing/costs.py`` and ``dims/context/plugin.py``'s wrapper.
"""
from __future__ import annotations

import dataclasses
import math

from .facts import layout_facts

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

# Bytes per parameter by implementation profile and precision: (parameters, gradients, optimizer per element of
# Adam state). "ultrascale": this package (FSDP2/DDP keep fp32 weights and gradients; bf16 is a compute dtype).
# "nanotron": the Playbook's runs (bf16 weights and gradients, fp32 gradient accumulation buffer, fp32 master
# weights kept by the optimizer). "megatron_deepspeed": the Frontier study's runs (Megatron's model in 16 bits, its
# 16-bit gradients accumulated in place, DeepSpeed's ZeRO-1 partitioning the fp32 master weights and Adam's moments;
# DeepSpeed's pipeline engine and activation checkpointing).
PROFILES = ("ultrascale", "nanotron", "megatron_deepspeed")
# the profiles whose model computes, and keeps its activations, in 16 bits whatever the layout says
SIXTEEN_BIT_PROFILES = ("nanotron", "megatron_deepspeed")
# state tensors per parameter, each in the parameter's dtype, except the low-bit ones
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "adamw_8bit": 2, "adamw_4bit": 2}
# torchao's low-bit AdamW (AdamW8bit, AdamW4bit): bits per state element, elements per fp32 block scale, entries of
# its fp32 lookup table. A state is quantized only where this rank's part of the parameter has at least 4,096
# elements and the block size divides them (torchao's rule, after bitsandbytes); the others stay in the parameter's
# dtype.
LOW_BIT_STATES = {"adamw_8bit": (8, 256, 256), "adamw_4bit": (4, 128, 16)}


def state_bytes(optimizer: str, numel: float, held: float) -> float:
    """Bytes of one optimizer state of a parameter of which this rank holds ``numel`` elements of ``held`` bytes."""
    low = LOW_BIT_STATES.get(optimizer)
    if low is not None and numel >= 4096 and numel % low[1] == 0:
        bits, block, table = low
        return numel * (bits / 8 + 4 / block) + 4 * table
    return numel * held


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
    the busy time), ``extra_flops`` (FLOPs per micro-batch on this rank beyond the model's: PEFT folding merged
    adapters into their weights), ``expert_matmul_gflop`` (GFLOP of one routed expert's matmul on this rank, when a
    dimension changes the rows an expert sees: expert parallelism gathers the ranks' tokens for its local experts;
    the planner's matmul efficiency for the experts' FLOPs follows it), and whatever a plugin adds."""

    memory: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(MEMORY_CATEGORIES, 0.0))
    terms: list = dataclasses.field(default_factory=list)
    factors: dict = dataclasses.field(default_factory=dict)
    micro_batches: int = 1  # per optimizer step on this rank (engine.estimate sets it from the shape)
    # the categories held in host memory, not on the device (offloaded shards, gradients and optimizer states);
    # ``host_copy_bytes`` in ``factors``: what crosses the host link per step, ``host_step_elements``: the
    # elements the optimizer steps on the host
    on_host: set = dataclasses.field(default_factory=set)
    host_bytes: float = 0.0  # held in host memory beyond those categories (offloaded activations)

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
    def optimizer_step_memory(self) -> float:
        """Bytes held during the optimizer step: the model states, what stays held through it (``step_other``:
        DDP's buckets) and the optimizer's temporaries (``step_temporary``); no activations."""
        temporary = 0.0 if "optimizer" in self.on_host else self.factors.get("step_temporary", 0.0)
        return (sum(self.memory.get(k, 0.0) for k in ("params", "grads", "optimizer") if k not in self.on_host)
                + self.factors.get("step_other", 0.0) + temporary)

    @property
    def total_memory(self) -> float:
        """The rank's device peak: the backward's (every category on the device at once) or the optimizer step's,
        whichever is larger."""
        return max(sum(v for k, v in self.memory.items() if k not in self.on_host), self.optimizer_step_memory)

    @property
    def host_memory(self) -> float:
        """Bytes this rank holds in host memory (the offloaded categories, the host optimizer's temporary)."""
        temporary = self.factors.get("step_temporary", 0.0) if "optimizer" in self.on_host else 0.0
        return sum(self.memory.get(k, 0.0) for k in self.on_host) + temporary + self.host_bytes


# ---- the parameter inventory --------------------------------------------------------------------------------
@dataclasses.dataclass
class ParamRecord:
    """One parameter (tied ones once). ``part``: "pre" (before the decoder layers: embeddings), "layer"
    (``layer`` is its index) or "post" (final norm, head). ``local``: the shape this rank holds, as the dimensions
    have cut it so far. ``tied_head``: the head uses this (embedding) weight too, so a pipeline's last stage holds a
    copy. ``active``: the share of it one token uses (MoE experts: top-k / experts). ``trainable``: it gets a
    gradient and optimizer state (a PEFT model's frozen base does not). ``lookup``: an untied input embedding (a
    lookup, not a matmul).

    A PEFT adapter's factor: ``adapter`` its kind (``lora_A``, ``lora_B``, ``lora_embedding_A``,
    ``lora_embedding_B``), ``adapter_of`` the name of the parameter it adapts, ``rank`` its rank; ``merged`` when
    PEFT folds the update into that parameter on every forward (its ``ParamWrapper``, for parameters targeted
    directly: a mixture of experts' fused 3-D expert weights and router) instead of running the factors on the
    tokens: the merged weight is then kept for the backward and gets a gradient, which flows on to the factors.

    ``held_bytes``: the element size of a frozen parameter held in a dtype other than fp32 (a PEFT model's bf16
    base), or, when the model's trainable parameters mix dtypes, of one held in a dtype other than fp32 (PEFT's bf16
    copy of a bf16 head beside fp32 adapters): its gradient and optimizer state take that size; 0 prices it by the
    layout's precision profile.

    ``view``: the mesh view the plan puts its module in (``ModelPlan.views``: experts under expert parallelism),
    whose plugin cuts it and over whose gradient axes data parallelism shards it; "" for the layout's own mesh."""

    name: str
    shape: tuple
    part: str
    layer: int | None = None
    tied_head: bool = False
    active: float = 1.0
    trainable: bool = True
    local: tuple = ()
    lookup: bool = False
    adapter: str = ""
    adapter_of: str = ""
    rank: int = 0
    merged: bool = False
    held_bytes: float = 0
    view: str = ""

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


@dataclasses.dataclass(frozen=True)
class Adapters:
    """Adapters priced on a model that has none (the planner's ``--peft lora``): ``method`` (the library whose
    ``WrapperLibrary.adapter_factors`` answers for it shapes them: PEFT's LoRA, ``features/peft/pricing.py``), rank
    ``r`` and ``target``, "all-linear" or module names (a module is targeted when its name is one of them or ends
    with "." and one). Scaling and dropout do not change what a rank holds, so they are not asked."""

    r: int = 16
    target: str | tuple = "all-linear"
    method: str = "lora"
    base_bytes: int = 2  # the frozen base's element size: bf16, as the recipes hold it (peft.base_dtype)
    quantized: str = ""  # the adapted base weights quantized (QLoRA: "nf4", ``QUANTIZED_BYTES``); "": as base_bytes

    def __post_init__(self):
        from .fields import ConfigError

        if not isinstance(self.method, str) or not self.method:
            raise ConfigError(f"adapters method {self.method!r}: must be a name. Fix: e.g. lora")
        if not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"LoRA rank {self.r!r}: must be a positive integer. Fix: e.g. r=16")
        target = self.target
        if isinstance(target, str) and target.lower() != "all-linear":
            target = tuple(t.strip() for t in target.split(",") if t.strip())
        elif not isinstance(target, str):
            target = tuple(target)
        else:
            target = "all-linear"
        if not target:
            raise ConfigError("LoRA targets: none given. Fix: 'all-linear' or module names such as q_proj,v_proj")
        if self.quantized and self.quantized not in QUANTIZED_BYTES:
            raise ConfigError(f"quantized base {self.quantized!r}: unknown. Fix: one of {', '.join(QUANTIZED_BYTES)}")
        object.__setattr__(self, "target", target)

    def describe(self) -> str:
        target = self.target if isinstance(self.target, str) else ",".join(self.target)
        base = f", the adapted base weights in {self.quantized.upper()}" if self.quantized else ""
        return f"{'Q' if self.quantized else ''}LoRA r={self.r} on {target}{base}"


# bytes per element of a quantized frozen weight: torchao's NF4 (QLoRA) packs 4 bits, one int8 scale per block of
# 64 and one fp32 factor per 256 scales (double quantization)
QUANTIZED_BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}


@dataclasses.dataclass(frozen=True)
class AdapterFactor:
    """One factor of an adapter: its parameter ``name``, its kind ``adapter`` (``lora_A``, ``lora_B``,
    ``lora_embedding_A``, ``lora_embedding_B``), the parameter it adapts (``adapter_of``), its ``rank``, whether it
    is ``merged`` into that parameter on every forward (``ParamRecord``), and its ``shape`` when it is priced on a
    model that does not hold it yet (None for a factor the model holds)."""

    name: str
    adapter: str
    adapter_of: str
    rank: int
    merged: bool = False
    shape: tuple | None = None


# ---- FLOPs --------------------------------------------------------------------------------------------------
def flops_per_token(records: list[ParamRecord], mc, seq_len: int, layers: int | None = None) -> tuple[float, float]:
    """(forward, backward) training FLOPs per token of ``records`` (PaLM appendix B, per parameter): 2 per weight
    a token uses in the forward; in the backward 2 for its input's gradient and 2 more for its own when it trains
    (or when PEFT merges a trained adapter into it); attention 4·L·a·d·s forward and twice that back, over
    ``layers`` (the model's, unless given). Lookups cost nothing, and merged adapters' factors run once per
    micro-batch, not per token (``merge_flops``). Training every weight, the backward is exactly twice the forward.
    (Frozen weights below the first trained one need no input gradient either; this counts them as if they did.)"""
    merged = {r.adapter_of for r in records if r.merged}
    fwd = bwd = 0.0
    for r in records:
        if r.lookup or r.merged:
            continue
        n = r.local_numel * r.active
        fwd += 2 * n
        bwd += 4 * n if (r.trainable or r.name in merged) else 2 * n
    heads = getattr(mc, "num_attention_heads", None) or 1
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    attn = 4 * (mc.num_hidden_layers if layers is None else layers) * heads * head_dim * seq_len
    return fwd + attn, bwd + 2 * attn


def merge_flops(records: list[ParamRecord]) -> float:
    """FLOPs per micro-batch of PEFT folding merged adapters into their weights (W + B·A, then the factors'
    gradients from the merged weight's: 3 × 2·numel(W)·r), over this rank's share of the weights."""
    size = {r.name: r.local_numel for r in records}
    return sum(6 * size.get(r.adapter_of, 0) * r.rank for r in records if r.merged and r.adapter == "lora_A")


# ---- closed forms ---------------------------------------------------------------------------------------------
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
    adapters: object = None  # the ``Adapters`` priced on a model that has none (the inventory holds their factors)

    def __post_init__(self):
        if self.profile not in PROFILES:  # each data-parallel plugin prices its memory per profile
            from .fields import ConfigError

            raise ConfigError(f"profile={self.profile!r}: no memory profile of that name. Fix: one of "
                              f"{', '.join(PROFILES)}")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    def head_split(self, config) -> int:
        """Over how many ranks the head's vocabulary rows are split: the ``tp`` degree when the model's plan
        shards the head, else 1."""
        tp = layout_facts(config).degree("tp")
        if tp == 1 or self.plan is None or self.model is None or not self.plan.lm_head:
            return 1
        return tp if self.plan.styles_module(self.model, self.plan.lm_head) else 1

    def activation_bytes(self, config) -> int:
        """Bytes of an activation element: the compute width the layout decides, 2 under nanotron's bf16 and
        Megatron's 16-bit model."""
        return 2 if (layout_facts(config).compute_bytes == 2 or self.profile in SIXTEEN_BIT_PROFILES) else 4

    # dict-style access for plugins written against the first interface (shape["seq_len"])
    def __getitem__(self, key):
        return getattr(self, key)

    def __setitem__(self, key, value):
        setattr(self, key, value)

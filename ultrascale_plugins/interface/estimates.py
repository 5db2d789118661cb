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

This module holds what every dimension shares (the ``Estimate``, the ``Shape``, the inventory); each built-in
dimension's own terms live beside it: ``dims/pipeline_costs.py``, ``dims/tp_costs.py``,
``dims/data_parallel_costs.py``, ``dims/activation_costs.py`` and ``dims/context_parallel.py``'s wrapper.
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
    active = expert_share(model.config)
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


def expert_share(mc) -> float:
    """top-k / experts of a mixture-of-experts config (1 for a dense model)."""
    experts = next((getattr(mc, k) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
                    if isinstance(getattr(mc, k, None), int) and getattr(mc, k) > 0), None)
    top_k = next((getattr(mc, k) for k in ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")
                  if isinstance(getattr(mc, k, None), int) and getattr(mc, k) > 0), None)
    return min(1.0, top_k / experts) if experts and top_k else 1.0


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

"""Splitting a Hugging Face decoder into pipeline stages, and which stages live on which rank.

Every stage is a copy of the causal LM in which the modules other stages own are replaced by ``Absent``
placeholders (no parameters, hidden states pass through). Layers keep their index in the ``ModuleList``, so
parameter names (FQNs) are those of the unsplit model and a checkpoint from one layout loads in another. Each stage
runs the model's own forward — embeddings (first stage), rotary embeddings, causal and padding masks, positions
(every stage, on the full sequence), norm and the causal-LM head's own forward (last stage) — so nothing about the
architecture is re-implemented here. The token ids travel with the hidden states.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from ...interface.config import ConfigError
from ...interface.moe_config import routed_experts

SINGLE_STAGE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
LOOPED = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble"}
V_SHAPED = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
# the schedules that split a stage's backward into input gradients (I) and weight gradients (W), see build_stage
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")


from ...models.placeholder import Absent  # noqa: E402 - re-exported for the pipeline's modules


def stages_per_rank(config) -> int:
    if config.pp_schedule in V_SHAPED:
        return 2
    if config.pp_schedule in LOOPED:
        return config.pp_virtual_stages
    return 1


def microbatches(config) -> int:
    return config.pp_microbatches or config.pp * stages_per_rank(config)


def stage_ids_for_rank(config, pp_rank: int) -> list[int]:
    p, v = config.pp, stages_per_rank(config)
    if config.pp_schedule in V_SHAPED:
        return [pp_rank, 2 * p - 1 - pp_rank]
    return [pp_rank + k * p for k in range(v)]


def pp_rank_of_stage(config, stage: int) -> int:
    """The pipeline rank holding ``stage`` (the inverse of ``stage_ids_for_rank``)."""
    p = config.pp
    if config.pp_schedule in V_SHAPED:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def split_layers(n_layers: int, n_stages: int, embed_cost: float = 1.0, head_cost: float = 1.0) -> list[int]:
    return list(_split_layers(n_layers, n_stages, embed_cost, head_cost))


@functools.lru_cache(maxsize=1024)  # the planner asks for the same few splits for thousands of layouts
def _split_layers(n_layers: int, n_stages: int, embed_cost: float, head_cost: float) -> tuple[int, ...]:
    """Contiguous layer counts per stage minimising the most loaded stage, where the embedding (first stage) and
    the head (last stage) count as ``embed_cost`` / ``head_cost`` layers of work. Every stage gets a layer."""
    best: dict = {}

    def solve(stage: int, start: int):  # -> (max cost, counts) for stages stage.. over layers start..
        key = (stage, start)
        if key in best:
            return best[key]
        left = n_stages - stage
        extra = (embed_cost if stage == 0 else 0.0) + (head_cost if stage == n_stages - 1 else 0.0)
        if left == 1:
            result = (n_layers - start + extra, [n_layers - start])
        else:
            result = (float("inf"), [])
            for count in range(1, n_layers - start - (left - 1) + 1):
                rest_cost, rest = solve(stage + 1, start + count)
                cost = max(count + extra, rest_cost)
                if cost < result[0]:
                    result = (cost, [count, *rest])
        best[key] = result
        return result

    return tuple(solve(0, 0)[1])


def stage_layer_counts(config, n_layers: int) -> list[int]:
    n_stages = config.pp * stages_per_rank(config)
    if config.pp_split:
        return list(config.pp_split)
    return split_layers(n_layers, n_stages)


def _base(model):
    """The base model inside the causal LM (its ``base_model_prefix`` attribute, or ``model``)."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return base if isinstance(base, nn.Module) and base is not model else getattr(model, "model", None)


def pp_parts(model) -> tuple[list[str], str, list[str]]:
    """(modules before the layers, the layers' ModuleList, modules after) of the base model, read from the
    architecture's ``base_model_pp_plan`` (``embed_tokens``/``layers``/``norm``, ``embed_in``/``emb_dropout``/
    ``layers``/``final_layer_norm``, ...)."""
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    base = _base(model)
    names = [n for n in plan if base is not None and hasattr(base, n)]
    lists = [n for n in names if isinstance(getattr(base, n), nn.ModuleList)]
    if len(lists) != 1 or not hasattr(model, "lm_head"):
        raise ConfigError(f"pp>1: model type '{model.config.model_type}' has no usable pipeline plan "
                          "(base_model_pp_plan naming its embeddings, layer list and final norm). Fix: use pp: 1, "
                          "or a model such as Llama, Qwen2, Mistral or GPT-NeoX")
    unplanned = [n for n, child in base.named_children()
                 if n not in names and any(True for _ in child.parameters())]
    if unplanned:
        raise ConfigError(f"pp>1: model type '{model.config.model_type}' has parameters outside its pipeline plan "
                          f"({unplanned}): no stage would own them. Fix: use pp: 1 for this model")
    i = names.index(lists[0])
    return names[:i], lists[0], names[i + 1:]


class ZeroEmbedding(Absent):
    """The input embedding on a stage that does not own it: zeros of the hidden size, which the model's own code
    before the layers may scale or add to; the stage's first layer then takes the received hidden states instead
    (see ``build_stage``). No parameters."""

    def __init__(self, hidden_size: int, received: dict):
        super().__init__()
        self.hidden_size, self.received = hidden_size, received

    def forward(self, input_ids=None, *args, **kwargs):
        x = self.received["x"]
        return x.new_zeros(*input_ids.shape, self.hidden_size)


def build_stage(model, stage_id: int, n_stages: int, layer_range: range, root: str = "") -> nn.Module:
    """This stage's copy of the causal LM (of ``model``, or of the wrapper ``model`` that holds the causal LM at
    ``root``: a PEFT model, whose stage is a copy of the whole wrapper under its own names). Every stage runs
    the model's own forward from the token ids — masks, rotary and position embeddings, whatever the base model
    computes before its layers — and a stage that receives hidden states hands them to its first layer in place
    of what the model computed there (so an embedding scale or an absolute position embedding is applied once,
    on the first stage, as in the unsplit model). The last stage runs the causal-LM head's own forward (logit
    scaling, soft-capping).

    Only this stage's modules are copied (see ``_stage_copy``): no other stage's weights are, and a meta-device
    model stays on the meta device. Through a wrapper, the stage runs the causal LM's own forward on the copy
    of it inside the copied wrapper: the wrapper's modules (PEFT's adapters) sit inside the causal LM's, and its
    own forward only hands the inputs on."""
    wrapper, model = model, (model.get_submodule(root) if root else model)
    parts = pp_parts(model)
    ends = (stage_id == 0, stage_id == n_stages - 1)  # (first, last)
    received: dict = {}
    stage = _stage_copy(wrapper, _placeholders(model, parts, layer_range, ends, received))
    inner = stage.get_submodule(root) if root else stage
    layers = getattr(_base(inner), parts[1])
    if not ends[0]:
        layers[layer_range.start].register_forward_pre_hook(_take_received(received), with_kwargs=True)
    sent: dict = {}
    if not ends[1]:
        # what the stage's last layer hands on, after every hook on it (sequence parallel gathers there): the
        # input of the next, absent layer. Models may transform the hidden states after their layers.
        layers[layer_range.stop].register_forward_pre_hook(_capture_input(sent), with_kwargs=True)
    # the runtime says per step whether the batch has a mask (the input is always one), and per schedule whether
    # the first stage's output must require a gradient (see _stage_forward)
    options = {"mask": True, "grad_chain": False}
    # an instance attribute: FSDP/TP hooks on the module still run around it
    stage.forward = _stage_forward(inner, type(model).forward, ends, (received, sent), options,
                                   routed_logits_width(model))
    stage.pipeline_options = options
    stage.pipeline_stage = (stage_id, n_stages)
    return stage


def _placeholders(model, parts: tuple, layer_range: range, ends: tuple, received: dict) -> dict[int, nn.Module]:
    """{id of a module of ``model`` another stage owns: this stage's placeholder}: the layers outside
    ``layer_range``; unless this stage is the first (``ends``: first, last), the modules before the layers (the
    input embedding: a ``ZeroEmbedding`` over ``received``); unless it is the last, those after them and the head.
    ``parts``: ``pp_parts(model)``."""
    before, layers_name, after = parts
    first, last = ends
    base_orig = _base(model)
    elsewhere: dict[int, nn.Module] = {}
    for i, layer in enumerate(getattr(base_orig, layers_name)):
        if i not in layer_range:
            elsewhere[id(layer)] = Absent()
    if not first:
        embed = model.get_input_embeddings()
        for name in before:
            child = getattr(base_orig, name)
            elsewhere[id(child)] = (ZeroEmbedding(model.config.get_text_config().hidden_size, received)
                                    if child is embed else Absent())
    if not last:
        for name in after:
            elsewhere[id(getattr(base_orig, name))] = Absent()
        elsewhere[id(model.lm_head)] = Absent()
    return elsewhere


def _stage_forward(inner, causal_lm_forward, ends: tuple, handoff: tuple, options: dict, routing: int):
    """The stage's forward: the model's own, from the token ids (the first stage's input) or with the received
    hidden states handed to the first layer; the last stage's logits (and, with ``routing`` experts, every stage's
    router logits), or what the stage's last layer hands on. ``inner``: the stage's causal LM; ``ends``: (first,
    last); ``handoff``: the (received, sent) slots the layers' hooks read and fill."""
    first, last = ends
    received, sent = handoff
    base = _base(inner)

    def forward(x, attention_mask, position_ids, input_ids=None, routed=None):
        if first:
            input_ids = x
        else:
            received["x"] = x
        # transformers finds packed documents from restarting positions only when no mask is given
        mask = attention_mask if options["mask"] else None
        kwargs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
        try:
            if last:
                result = causal_lm_forward(inner, **kwargs)
                if routing:  # every stage's router logits, for the auxiliary loss of this micro-batch
                    return _own(result.logits), _routed(routed, result, routing, x), attention_mask
                return _own(result.logits)
            result = base(**kwargs)
            out = _own(sent["x"])
            if first and options["grad_chain"] and not out.requires_grad and torch.is_grad_enabled():
                # A frozen first stage (a PEFT model with adapters only in later layers) hands on hidden states that
                # need no gradient, and so would every stage up to the first one that trains. torch's I/W split
                # (stage_backward_input) finds a stage's weight gradients only through the autograd nodes between
                # its inputs and its outputs: with no input requiring a gradient the W pass computes nothing and
                # the adapters get no gradient. A leaf that requires one keeps every later stage's input on the
                # graph (the cost: input gradients through the frozen stages before the first trained one).
                out = out.detach().requires_grad_()
            if routing:
                return out, attention_mask, position_ids, input_ids, _routed(routed, result, routing, x)
            return out, attention_mask, position_ids, input_ids
        finally:
            received.clear()
            sent.clear()

    return forward


def routed_logits_width(model) -> int:
    """With the router auxiliary loss on (``output_router_logits``), the number of experts: each stage then hands
    the next one the router logits of every layer so far (one [tokens x layers, experts] tensor that the
    gradient of the auxiliary loss flows back through), and the last stage hands them to the loss; else 0."""
    if not getattr(model.config, "output_router_logits", False):
        return 0
    # the expert count the auxiliary loss reads from the causal LM (the routers feature refuses, before any
    # transform, a model that computes that loss another way), else the config's
    return int(getattr(model, "num_experts", None) or routed_experts(model.config))


def _routed(previous, result, width: int, like: torch.Tensor) -> torch.Tensor:
    """The router logits of the stages so far: ``previous`` (received) followed by this stage's layers'."""
    own = [t.reshape(-1, width) for t in (getattr(result, "router_logits", None) or ())]
    parts = ([previous] if previous is not None else []) + own
    if not parts:  # a first stage whose layers all lack routers (dense layers of a MoE model)
        return torch.zeros(0, width, device=like.device)
    return torch.cat([p.float() for p in parts])


def _stage_copy(model: nn.Module, elsewhere: dict[int, nn.Module]) -> nn.Module:
    """A copy of ``model``'s module tree in which each module another stage owns (``elsewhere``: id -> placeholder)
    is its placeholder; the traversal never enters those. The stage's parameters are new ``Parameter`` objects
    over the same storage (on the meta device there is none), so each stage is its own module tree for the
    transforms to shard and the model's own ``Parameter`` objects are left as they were. A parameter shared with
    a module another stage owns (the tied embedding/head) is a separate parameter on each of the two stages, and
    only the stage holding its first occurrence shares the storage: when both stages live on one rank (V
    schedules) the optimizer steps each copy. Buffers and plain attributes are copied, as before."""
    memo: dict[int, object] = dict(elsewhere)
    away: set[int] = set()  # the modules other stages own, and everything inside them
    for m in model.modules():
        if id(m) in elsewhere:
            away.update(id(sub) for sub in m.modules())
    first_holder: dict[int, nn.Module] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                first_holder.setdefault(id(p), m)
    for m in model.modules():
        if id(m) in away:
            continue
        for p in m._parameters.values():
            if p is None or id(p) in memo:
                continue
            # shared with a module another stage owns: the stage holding its first occurrence (the embedding's
            # stage for a tied head) keeps the storage, the other one gets a copy
            shared = p.is_meta or id(first_holder[id(p)]) not in away
            memo[id(p)] = type(p)(p.detach() if shared else p.detach().clone(), p.requires_grad)
    return copy.deepcopy(model, memo)

def _capture_input(sent: dict):
    def hook(module, args, kwargs):
        sent["x"] = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")

    return hook


def _take_received(received: dict):
    """Forward pre-hook on a stage's first layer: its hidden states are the ones the previous stage sent."""

    def hook(module, args, kwargs):
        x = received.get("x")
        if x is None:
            return None
        if args and isinstance(args[0], torch.Tensor):
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    return hook


def _own(t):
    """A stage output that is not a view: the zero-bubble schedules detach stage outputs in place, which torch
    refuses for views (sequence parallel's gather hands back one). A copy keeps what a plugin marked on the tensor
    (the chunked head marks its per-token losses)."""
    if not t._is_view():
        return t
    out = t.clone()
    out.__dict__.update(t.__dict__)
    return out

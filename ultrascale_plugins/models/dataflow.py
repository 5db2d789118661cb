"""Which parameters the tensor-parallel plan leaves whole but that meet rank-local data.

Inside a TP region a column-parallel layer hands each rank its own slice of the features (heads, intermediate
units). A parameter the plan does not shard that is applied to that slice — a per-head norm, a learnable
activation, an attention sink — gets a different, partial gradient on each rank, and the true gradient is their
sum. Names alone cannot tell: DeepSeek's ``q_a_layernorm`` sits in the same attention block as Qwen3's
``q_norm`` but sees replicated data. So this module traces the data: the model's own forward runs once on the
meta device (no memory, no compute) with a ``TorchFunctionMode`` that marks every tensor derived from a sharded
column-parallel output as rank-local until a reducing layer (row-parallel, gathered, experts) produces a
replicated one, and records for every parameter whether it was combined with rank-local data, replicated data,
or both.

transformers' own plans mark such parameters where their authors saw them (``replicated_with_grad_allreduce``);
this finds the ones they did not (e.g. Apertus's xIELU activation parameters between ``up_proj`` and
``down_proj``).

The same run finds the regions that can reduce their input's gradient once (Megatron's count): a region whose
input reaches nothing but column-parallel layers (directly or through views, casts and dropout), each of which
then leaves its input's gradient partial, so their sum is reduced once at the region's entry. Anything else that
reads the input (a router, a replicated adapter, a norm, a residual inside the region) keeps the region on one
reduction per projection: a consumer whose input gradient is whole would be summed tp times.

And it finds whether the head end can do the same under sequence parallel: the last layer's output reaches
nothing but the head (through the final norm and any other operation with parameters of its own), so the
head can leave its input's gradient partial and the last layer's gather reduce-scatters it once; the
parameters on the way (the final norm's) then see a partial gradient and are summed over TP.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..interface.meta_copy import meta_copy

LOCAL, ACTIVATION = "local", "activation"
# What may touch a region's input on its way to the column-parallel layers: the result is the same data (a
# view, a cast, dropout), so its gradient is partial where theirs is.
_PASS_THROUGH = {"__get__", "size", "dim", "view", "reshape", "flatten", "unflatten", "contiguous", "to", "float",
                 "half", "bfloat16", "type_as", "dropout", "unsqueeze", "squeeze", "__getitem__", "numel"}


@dataclasses.dataclass
class TpDataflow:
    local: set[str]  # plain parameters combined only with rank-local data: gradients summed over TP
    mixed: set[str]  # plain parameters combined with both: refused
    block: dict[str, set[str]]  # region -> its column-parallel layers, for regions that reduce their input once
    scaled: dict[str, set[str]]  # region -> modules reading its input whose input gradient is whole: x 1/tp
    end: set[str] | None = None  # under SP, parameters between the last layer and a head that leaves its input's
    #                              gradient partial (summed over TP); None: the head reduces its own input
    sums: set[str] = dataclasses.field(default_factory=set)  # regions whose output can be summed once, at its end
    summed_params: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # region -> parameters applied
    #                                                         to its partial sums: their gradients summed over TP
    start: bool = False  # the vocabulary-parallel embedding's partial sum can reach the first layer unreduced
    per_projection: dict[str, str] = dataclasses.field(default_factory=dict)  # region -> why its input is reduced
    #                                                                           per projection
    whole_readers: set[str] = dataclasses.field(default_factory=set)  # regions whose readers all hand back whole
    #                                                                   gradients: their input needs no reduction
    sum_why: dict[str, str] = dataclasses.field(default_factory=dict)  # region -> what its partial sum met that
    #                                                                    needs the sum first (the first seen)
    gates: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # region -> readers of its input whose
    #    output (through one-input operations) multiplies its partial sum: where the region reduces that sum once,
    #    their gradient is partial, not whole (no 1/tp; their parameters' gradients summed over TP)
    sum_end: dict[str, str] = dataclasses.field(default_factory=dict)  # region -> the norm inside it applied to
    #    its sum, whose output is the region's: the sum is reduced (scattered under SP) at that norm's input


def _sharding_output(style: str, is_head: bool) -> bool:
    """Does a module of this style hand each rank a different slice of its output features?"""
    return "colwise" in style and "gather" not in style and style != "colwise_rep" and not is_head


def _reducing_output(style: str) -> bool:
    """Is this module's output the same on every rank (reduced or gathered)?"""
    return not _sharding_output(style, False) or style in ("moe_tp_experts",)


class _Trace(TorchFunctionMode):
    def __init__(self, params: dict[int, str]):
        super().__init__()
        self.kind: dict[int, object] = {}  # id(tensor) -> LOCAL | ACTIVATION | frozenset(param names)
        self.keep: list = []  # ids stay valid while the trace runs
        self.params = params
        self.local_use: set[str] = set()
        self.replicated_use: set[str] = set()
        self.region_in: dict[int, str] = {}  # id(tensor) -> the region whose input it is (or a view of it)
        self.inside = 0  # > 0 while the trace itself operates
        self.consumers: dict[str, set[str]] = {}  # region -> layers that leave their input's gradient partial
        self.scaled: dict[str, set[str]] = {}  # region -> modules whose input's gradient is whole on every rank
        self.fed_other: set[str] = set()  # partial-capable layers also fed something else than a region input
        self.follow: dict[int, frozenset] = {}  # id(tensor) -> regions: derived from "full" consumers' outputs
        self.other: set[str] = set()  # regions whose input something else reads
        self.bad: set[str] = set()  # regions where a "full" consumer's output meets rank-local data
        self.why: dict[str, str] = {}  # region -> why it reduces per projection (the first reason seen)
        self.partial: dict[int, str] = {}  # id(tensor) -> region: a partial sum of that region's output
        self.partial_bad: set[str] = set()
        self.sum_why: dict[str, str] = {}
        self.sum_end: dict[str, str] = {}
        self.gate_of: dict[int, str] = {}  # id(tensor) -> the "full" reader whose output it is, or a function of
        #                                    that output alone (a gate on its way to a partial sum)
        self.gates: dict[str, str] = {}  # reader -> region: its output's function multiplies that region's sum
        self.gate_bad: set[str] = set()  # readers whose output reaches anything else
        self.gate_read: set[int] = set()
        self.partial_params: dict[str, set[str]] = {}  # region -> parameters applied to its partial sums
        self.in_tail = 0  # > 0 while a norm applied to a region's partial sum runs (see _watch_tails)
        self.tail_out: dict[int, tuple[str, str]] = {}  # id(tensor) -> (region, norm): that norm's output
        self.partial_param_uses: dict[str, int] = {}
        self.param_data_uses: dict[str, int] = {}
        self.sums: set[str] = set()  # regions whose output is a partial sum
        self.start: set[int] | None = None  # ids derived from a vocabulary-parallel embedding's output
        self.start_ok = True
        self.end: set[int] | None = None  # ids derived from the last layer's output (when the head end is watched)
        self.end_ok = True
        self.end_params: set[str] = set()  # parameters applied to them
        self.other_params: set[str] = set()  # parameters applied to anything else

    def mark(self, tensors, kind) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.kind[id(t)] = kind
                self.keep.append(t)

    def kind_of(self, t):
        if id(t) in self.params:
            return frozenset([self.params[id(t)]])
        return self.kind.get(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        kinds = [self.kind_of(t) for t in inputs]
        owners = frozenset().union(*(k for k in kinds if isinstance(k, frozenset)))
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.end is not None and not self.inside:
            ended = [id(t) in self.end for t in inputs]
            if any(ended):
                if any(not e and self.kind_of(t) in (LOCAL, ACTIVATION) for e, t in zip(ended, inputs)):
                    self.end_ok = False  # mixed with other data: its gradient would not be partial alone
                self.end_params |= owners
                for t in outs:
                    self.end.add(id(t))
                    self.keep.append(t)
            elif any(not isinstance(k, frozenset) for k in kinds):  # applied to other data (not w.float())
                self.other_params |= owners
        if owners and any(not isinstance(k, frozenset) for k in kinds):
            for owner in owners:
                self.param_data_uses[owner] = self.param_data_uses.get(owner, 0) + 1
        if self.gate_of and not self.inside:
            _gate_op(self, func, inputs, outs)
        if self.partial and not self.in_tail:
            _partial_op(self, func, inputs, args, kwargs, outs)
        if self.start is not None and not self.inside:
            _start_op(self, func, inputs, args, kwargs, outs)
        regions = {self.region_in[id(t)] for t in inputs if id(t) in self.region_in}
        # no gradient flows through integers and booleans (top-k indices, masks made from them): not followed
        followed = frozenset().union(*(self.follow[id(t)] for t in inputs
                                       if id(t) in self.follow and t.is_floating_point()))
        if followed:
            if LOCAL in kinds:  # its gradient would be this rank's part only, not whole
                for region in followed - self.bad:
                    self.why.setdefault(region, "a reader of whole parameters meets this rank's features "
                                                f"({getattr(func, '__name__', func)})")
                self.bad |= followed
            for t in outs:
                if t.is_floating_point():
                    self.follow[id(t)] = followed
                    self.keep.append(t)
        if regions and not self.inside:
            if getattr(func, "__name__", "") in _PASS_THROUGH and len(regions) == 1:
                for t in outs:
                    self.region_in[id(t)] = next(iter(regions))
                    self.keep.append(t)
            else:
                for region in regions - self.other:
                    self.why.setdefault(region, f"its input read by {getattr(func, '__name__', func)}")
                self.other |= regions
        if LOCAL in kinds:
            self.local_use |= owners
            self.mark(outs, LOCAL)
        elif ACTIVATION in kinds:
            self.replicated_use |= owners
            self.mark(outs, ACTIVATION)
        elif owners:
            self.mark(outs, owners)  # e.g. weight.float(): still the parameter
        return out


def meta_twin(model: nn.Module) -> nn.Module:
    """A fresh copy of ``model``'s architecture on the meta device, configured to run there (eager attention,
    experts without grouped_mm, no router auxiliary loss), in eval mode. A Hugging Face model is rebuilt from
    its config (``config_to_rebuild``); anything else (a wrapper around one, such as a PEFT model, whose adapters
    are part of the architecture) is copied structurally, with its own copy of the config."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        config = config_to_rebuild(model)
    else:
        twin = meta_copy(model, meta_buffers=True)
        config = twin.config
    config._attn_implementation = "eager"
    if getattr(config, "_experts_implementation", None) is not None:
        # grouped_mm's meta kernel accepts bf16 only; batched_mm has the same data flow and runs on meta
        config._experts_implementation = "batched_mm"
    if getattr(config, "output_router_logits", False):  # the auxiliary loss reads routing values: not on meta
        config.output_router_logits = False
    if isinstance(model, PreTrainedModel):
        with torch.device("meta"):
            twin = type(model)(config)
    return twin.eval()


def config_to_rebuild(model: nn.Module):
    """A copy of ``model.config`` that ``type(model)`` can be built from again, with the embedding the model has.
    A pad id outside the input embedding (a tokenizer's pad token added without resizing it, whose id TRL copies
    into the config after the model was built) would stop the constructor (nn.Embedding asserts on its padding
    index): the copy takes the padding index the model's embedding was built with instead."""
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model without one: nothing to compare the pad id with
        return config
    pad, rows = getattr(text, "pad_token_id", None), getattr(embedding, "num_embeddings", None)
    if isinstance(pad, int) and isinstance(rows, int) and not -rows <= pad < rows:
        text.pad_token_id = getattr(embedding, "padding_idx", None)
    return config


def meta_inputs(seq: int) -> dict:
    """Inputs for one forward of a meta twin over ``seq`` tokens: a 4-D attention mask, so the model builds no
    mask of its own (that reads values), and explicit positions."""
    return dict(input_ids=torch.zeros(1, seq, dtype=torch.long, device="meta"),
                attention_mask=torch.zeros(1, 1, seq, seq, device="meta"),
                position_ids=torch.arange(seq, device="meta")[None], use_cache=False)


def _first_input(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return kwargs.get("hidden_states") if isinstance(kwargs.get("hidden_states"), torch.Tensor) else None


def trace_tp(model: nn.Module, plan, partial_input=lambda fqn, style, module: False) -> TpDataflow:
    """The parameters that meet rank-local data (plain parameters only: the ones the plan shards are left out)
    and the regions that reduce their input once; ``partial_input(fqn, style, module)``: can that layer leave
    its input's gradient partial? Traced on a meta-device twin of ``model``."""
    matched = plan.matches(model)
    named = dict(plan.param_matches(model))
    twin = meta_twin(model)
    sharded_owner = {fqn for fqn, style in matched.items() if style != "replicated_with_grad_allreduce"}
    # a planned module holding other planned modules (an attention block whose style runs it on its own local
    # parameters) claims only its own: what else it holds is traced like any parameter
    holders = {fqn for fqn in sharded_owner if any(f.startswith(fqn + ".") for f in matched)}
    planned = set(named) | {f"{m}.{p}" for m in sharded_owner
                            for p, _ in twin.get_submodule(m).named_parameters(recurse=m not in holders)}
    params = {id(p): name for name, p in twin.named_parameters(remove_duplicate=False) if name not in planned}
    trace = _Trace(params)
    hooks = []
    for fqn, style in matched.items():
        module = twin.get_submodule(fqn)
        if style == "moe_tp_experts":  # its own parameters are sharded; it sums its output over TP
            module.forward = lambda hidden_states, *a, **k: hidden_states.new_zeros(hidden_states.shape)
        if _sharding_output(style, fqn == plan.lm_head):
            hooks.append(module.register_forward_hook(lambda m, a, out: trace.mark(tree_flatten(out)[0], LOCAL)))
        elif _reducing_output(style):
            hooks.append(module.register_forward_hook(
                lambda m, a, out: trace.mark(tree_flatten(out)[0], ACTIVATION)))
    _watch_regions(twin, plan, matched, trace, partial_input, hooks)
    head_style = matched.get(plan.lm_head)
    if plan.layers and head_style is not None and partial_input(plan.lm_head, head_style, twin.get_submodule(
            plan.lm_head)):
        _watch_end(twin, plan, trace, hooks)
    if plan.layers and plan.embedding is not None and matched.get(plan.embedding) in VOCAB_PARALLEL:
        _watch_start(twin, plan, trace, hooks)
    inputs = meta_inputs(8)
    trace.mark([v for v in inputs.values() if isinstance(v, torch.Tensor)], ACTIVATION)
    try:
        with torch.no_grad(), trace:
            outputs = twin(**inputs)
        if trace.end is not None and any(id(t) in trace.end for t in tree_flatten(dict(outputs))[0]):
            trace.end_ok = False  # the last layer's output leaves the model by another way than the head
        if trace.start is not None and any(id(t) in trace.start for t in tree_flatten(dict(outputs))[0]):
            trace.start_ok = False
    finally:
        for h in hooks:
            h.remove()
    # a layer fed both its region's input and other data would reduce neither right: its region falls back
    fallback = trace.other | trace.bad | {r for r, c in trace.consumers.items() if c & trace.fed_other}
    for r, c in trace.consumers.items():
        if c & trace.fed_other:
            trace.why.setdefault(r, f"{sorted(c & trace.fed_other)[0]} is also fed other data")
    block = {r: c for r, c in trace.consumers.items() if r not in fallback}
    # read only by layers that hand back whole gradients (latent attention's down-projections): nothing to reduce
    whole_readers = {r for r in trace.scaled if r not in trace.consumers and r not in fallback}
    scaled = {r: c for r, c in trace.scaled.items() if r in block}
    end = None
    if trace.end is not None and trace.end_ok and trace.end_seen and not trace.end_params & trace.other_params:
        end = set(trace.end_params)
    gates: dict[str, set[str]] = {}
    for reader, region in trace.gates.items():
        if reader in trace.gate_bad or region not in block:  # its gradient would be whole (or reduced) elsewhere
            trace.partial_bad.add(region)
            trace.sum_why.setdefault(region, f"the gate {reader} is also read elsewhere" if reader in trace.gate_bad
                                     else f"the gate {reader} reads an input reduced per projection")
        else:
            gates.setdefault(region, set()).add(reader)
    sums = {r for r in trace.sums - trace.partial_bad  # a parameter also applied elsewhere cannot be summed
            if all(trace.partial_param_uses[p] == trace.param_data_uses.get(p) for p in trace.partial_params.get(r, ()))}
    start = trace.start is not None and trace.start_ok and trace.start_seen
    return TpDataflow(trace.local_use - trace.replicated_use, trace.local_use & trace.replicated_use, block, scaled,
                      end, sums, {r: trace.partial_params[r] for r in sums if r in trace.partial_params}, start,
                      {r: trace.why.get(r, "no column-parallel layer reads its input") for r in plan.regions
                       if r not in block and r not in whole_readers}, whole_readers,
                      {r: w for r, w in trace.sum_why.items() if r not in sums},
                      {r: g for r, g in gates.items() if r in sums},
                      {r: m for r, m in trace.sum_end.items() if r in sums})


VOCAB_PARALLEL = {"embedding_rowwise", "vocab_parallel_embedding"}


def _watch_start(twin, plan, trace: "_Trace", hooks: list) -> None:
    """Mark the vocabulary-parallel embedding's output: it must reach the first layer unchanged or scaled by a
    constant (Gemma's normalizer), and nothing else may read it."""
    trace.start, trace.start_seen = set(), False
    embedding = twin.get_submodule(plan.embedding)
    # torch's own lookup only (LocalVocabEmbedding replaces it): a subclass may do more, e.g. Gemma's scaling
    if type(embedding).forward is not nn.Embedding.forward or embedding.max_norm is not None \
            or embedding.scale_grad_by_freq or embedding.sparse:
        trace.start_ok = False
        return

    def mark(m, args, out):
        if not isinstance(out, torch.Tensor):
            trace.start_ok = False
            return None
        return _fresh_view(trace, out, trace.start)

    hooks.append(embedding.register_forward_hook(mark))
    hooks.append(twin.get_submodule(plan.layers[0]).register_forward_pre_hook(_reads(trace, "start"), with_kwargs=True))


def _reads(trace: "_Trace", end: str):
    """The pre-hook of the module that must read the marked ``end`` ("start": the first layer, "end": the head):
    fed anything else, that end stays as it is; fed the mark, it is seen (and handed an unmarked view)."""
    def hook(m, args, kwargs):
        x = _first_input(args, kwargs)
        if x is None or id(x) not in getattr(trace, end):
            setattr(trace, f"{end}_ok", False)
            return None
        setattr(trace, f"{end}_seen", True)
        return _hand_in(trace, None, args, kwargs, False)

    return hook


def _fresh_view(trace: "_Trace", x: torch.Tensor, marks: set) -> torch.Tensor:
    """A view of ``x`` (not itself a use of it) whose id joins ``marks``."""
    trace.inside += 1
    try:
        y = x.view_as(x)
    finally:
        trace.inside -= 1
    marks.add(id(y))
    trace.keep.append(y)
    return y


def _start_op(trace: "_Trace", func, inputs, args, kwargs, outs) -> None:
    """The embedding's output on its way to the first layer: viewed, cast, or scaled by a constant only."""
    started = [id(t) in trace.start for t in inputs]
    if not any(started):
        return
    name = getattr(func, "__name__", "")
    constants = all(s or (trace.kind_of(t) is None) for s, t in zip(started, inputs))
    if sum(started) == 1 and (name in _PASS_THROUGH and len(inputs) == 1 or name in _SCALES and constants):
        for t in outs:
            trace.start.add(id(t))
            trace.keep.append(t)
    else:
        trace.start_ok = False


def _watch_end(twin, plan, trace: "_Trace", hooks: list) -> None:
    """Mark the last layer's output; the head must read it (and nothing else may leave the model with it)."""
    trace.end, trace.end_seen = set(), False

    def mark(m, args, out):
        first = out[0] if isinstance(out, tuple) else out
        if not isinstance(first, torch.Tensor):
            return None
        y = _fresh_view(trace, first, trace.end)
        return (y, *out[1:]) if isinstance(out, tuple) else y

    hooks.append(twin.get_submodule(plan.layers[-1]).register_forward_hook(mark))
    hooks.append(twin.get_submodule(plan.lm_head).register_forward_pre_hook(_reads(trace, "end"), with_kwargs=True))


def region_of(plan, fqn: str) -> str | None:
    return next((r for r in plan.regions if fqn.startswith(r + ".")), None)


def _watch_regions(twin, plan, matched: dict, trace: "_Trace", partial_input, hooks: list) -> None:
    """Hooks on the twin that find, for every region, who reads its input (see the module docstring)."""
    modules = dict(twin.named_modules())
    planned = set(matched) | {f.rpartition(".")[0] for f in plan.param_matches(twin)}
    style_of = matched.get
    for region in plan.regions:
        if region in modules:
            hooks.append(modules[region].register_forward_pre_hook(
                lambda m, args, kwargs, region=region: _hand_in(trace, region, args, kwargs, True), with_kwargs=True))
    for fqn, module in modules.items():
        region = region_of(plan, fqn)
        if region is None:
            continue
        style = matched.get(fqn)
        if style is not None and partial_input(fqn, style, module):
            kind = "partial"
        elif style in FULL_INPUT_GRAD or (
                style is None and any(True for _ in module.parameters())
                and not any(f == fqn or f.startswith(fqn + ".") for f in planned)):
            kind = "full"  # its input's gradient is the same on every rank: scaled by 1/tp in the region's sum
        else:
            continue  # looked through: the operations inside are what read the input

        def enter(m, args, kwargs, fqn=fqn, region=region, kind=kind):
            x = _first_input(args, kwargs)
            if x is None or trace.region_in.get(id(x)) != region:
                if kind == "partial":  # this layer reduces its own input then: it must not be made partial
                    trace.fed_other.add(fqn)
                # a layer that reduces its own input hands back a whole gradient: what it reads is not followed
                m._ultrascale_trace_after = "unfollow" if kind == "partial" or style_of(fqn) in FULL_INPUT_GRAD \
                    else None
                return None
            (trace.consumers if kind == "partial" else trace.scaled).setdefault(region, set()).add(fqn)
            # its output's gradient must stay whole: followed
            m._ultrascale_trace_after = region if kind == "full" and style_of(fqn) not in FULL_INPUT_GRAD else None
            return _hand_in(trace, None, args, kwargs, False)

        def leave(m, args, out, fqn=fqn):
            after, m._ultrascale_trace_after = getattr(m, "_ultrascale_trace_after", None), None
            for t in tree_flatten(out)[0] if after is not None else ():
                if not isinstance(t, torch.Tensor):
                    continue
                if after == "unfollow":
                    trace.follow.pop(id(t), None)
                else:
                    trace.follow[id(t)] = trace.follow.get(id(t), frozenset()) | {after}
                    trace.gate_of[id(t)] = fqn
                    trace.keep.append(t)

        hooks.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(module.register_forward_hook(leave))
    for fqn, style in matched.items():  # the region's addends: row-parallel layers and TP experts
        region = region_of(plan, fqn)
        if region is not None and (style in ROWWISE_SUMS or style == "moe_tp_experts"):
            hooks.append(modules[fqn].register_forward_hook(
                lambda m, a, out, region=region: _mark_partial(trace, region, out)))
    _watch_tails(modules, plan, planned, trace, hooks)
    for region in plan.regions:
        if region in modules:
            hooks.append(modules[region].register_forward_hook(
                lambda m, a, out, region=region: _leave_region(trace, region, out)))


def _watch_tails(modules: dict, plan, planned: set, trace: "_Trace", hooks: list) -> None:
    """A norm inside a region applied to the region's partial sum (A.X-K1's ``post_mlp_layernorm`` on the MoE
    block's output): the sum can be reduced at the norm's input instead of inside each addend, if the norm's output
    is the region's. Its operations on the sum are the norm's (per token, so it can run on sequence shards)."""
    for fqn, module in modules.items():
        region = region_of(plan, fqn)
        if region is None or fqn in planned or "norm" not in type(module).__name__.lower():
            continue

        def enter(m, args, kwargs, region=region):
            x = _first_input(args, kwargs)
            m._ultrascale_tail = region if x is not None and trace.partial.get(id(x)) == region else None
            trace.in_tail += m._ultrascale_tail is not None

        def leave(m, args, out, fqn=fqn):
            region, m._ultrascale_tail = getattr(m, "_ultrascale_tail", None), None
            if region is None:
                return
            trace.in_tail -= 1
            first = out[0] if isinstance(out, tuple) and out else out
            if isinstance(first, torch.Tensor):
                trace.tail_out[id(first)] = (region, fqn)
                trace.keep.append(first)

        hooks.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(module.register_forward_hook(leave))


ROWWISE_SUMS = {"rowwise", "unit_rowwise"}  # row-parallel styles whose output can stay a partial sum
_SUMS = {"add", "__add__", "__radd__", "add_", "__iadd__", "sub", "__sub__", "sub_", "__isub__"}
_SCALES = {"mul", "__mul__", "__rmul__", "mul_", "__imul__", "div", "__truediv__", "div_", "__itruediv__"}


def _mark_partial(trace: "_Trace", region: str, out) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            trace.partial[id(t)] = region
            trace.keep.append(t)


def _leave_region(trace: "_Trace", region: str, out) -> None:
    """The region's output is reduced where it ends: its gradient is whole again, whatever it came from."""
    first = out[0] if isinstance(out, tuple) and out else out
    if isinstance(first, torch.Tensor):
        trace.follow.pop(id(first), None)
    if isinstance(first, torch.Tensor) and trace.partial.get(id(first)) == region:
        trace.sums.add(region)
        del trace.partial[id(first)]  # reduced where the region ends
    elif isinstance(first, torch.Tensor) and trace.tail_out.get(id(first), ("",))[0] == region:
        trace.sums.add(region)  # reduced at its last norm's input
        trace.sum_end[region] = trace.tail_out[id(first)][1]


def _kind_name(kind) -> str:
    return "param" if isinstance(kind, frozenset) else str(kind)


_PRODUCTS = {"mul", "__mul__", "__rmul__"}
_GATES = _PRODUCTS | {"div", "__truediv__"}


def _gate_op(trace: "_Trace", func, inputs, outs) -> None:
    """Follow a "full" reader's output on its way to gate a partial sum (Qwen2-MoE's
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``): a chain of one-input operations, each tensor read once.
    Any other use makes the reader a plain one (its output's gradient must be whole)."""
    readers = {trace.gate_of[id(t)] for t in inputs if id(t) in trace.gate_of}
    if not readers:
        return
    name = getattr(func, "__name__", "")
    read_twice = any(id(t) in trace.gate_read for t in inputs if id(t) in trace.gate_of)
    trace.gate_read |= {id(t) for t in inputs if id(t) in trace.gate_of}
    partial = any(id(t) in trace.partial for t in inputs)
    chain = len(readers) == 1 and not read_twice
    if chain and len(inputs) == 1 and len(outs) == 1:
        trace.gate_of[id(outs[0])] = next(iter(readers))
        trace.keep.append(outs[0])
    elif not (chain and len(inputs) == 2 and partial and name in _GATES):  # the product: _partial_op decides
        trace.gate_bad |= readers


def _partial_op(trace: "_Trace", func, inputs, args, kwargs, outs) -> None:
    """Follow the regions' partial sums: they may be viewed, scaled by a number and added to each other; any
    other use (a product with data, a sum with a whole tensor) needs the sum first: that region reduces inside."""
    held = [trace.partial.get(id(t)) for t in inputs]
    regions = {r for r in held if r is not None}
    if not regions:
        return
    name = getattr(func, "__name__", "")
    numbers_only = not any(isinstance(a, (int, float)) and not isinstance(a, bool) and name in _SUMS
                           for a in tree_flatten((args, kwargs))[0])
    if name in _SCALES:
        numbers_only = all(not isinstance(a, torch.Tensor) for a in tree_flatten((args[1:], kwargs))[0])
    ok = len(regions) == 1 and (
        (name in _SUMS and len(inputs) == 2 and all(r is not None for r in held) and numbers_only)
        or (len(inputs) == 1 and (name in _PASS_THROUGH or (name in _SCALES and numbers_only))))
    if not ok and len(regions) == 1 and name in _GATES and len(inputs) == 2 and held.count(None) == 1 \
            and (name in _PRODUCTS or held[0] is not None):
        gate = inputs[held.index(None)]
        reader = trace.gate_of.get(id(gate))
        if reader is not None and trace.kind_of(gate) == ACTIVATION and reader not in trace.gate_bad:
            # sum_i(g * p_i) = g * sum_i(p_i): the product is a partial sum too, and g's gradient on each rank is
            # that rank's part (summed by the region's input reduction and over TP for the reader's parameters)
            ok = True
            trace.gates[reader] = next(iter(regions))
    if not ok and len(regions) == 1 and name == "linear" and len(inputs) == 2 and held[0] is not None:
        owner = trace.kind_of(inputs[1])  # a replicated bias-free linear (LoRA's B after a row-parallel A):
        if isinstance(owner, frozenset):  # linear in its input, so the sum passes; its weight's gradient is
            ok = True                     # then partial too, and summed over TP
            trace.partial_params.setdefault(next(iter(regions)), set()).update(owner)
            for p in owner:
                trace.partial_param_uses[p] = trace.partial_param_uses.get(p, 0) + 1
    if not ok:
        kinds = "+".join(sorted({"partial" if h else _kind_name(trace.kind_of(t)) for h, t in zip(held, inputs)}))
        for region in regions - trace.partial_bad:
            trace.sum_why.setdefault(region, f"{name}({kinds})")  # e.g. add(activation+partial)
        trace.partial_bad |= regions
        return
    for t in outs:
        trace.partial[id(t)] = next(iter(regions))
        trace.keep.append(t)


# Styles whose module hands back a whole input gradient whatever follows: they reduce (or gather) it themselves;
# latent attention's kv_a_proj is replicated and the parts of its output reach a column-parallel layer and a
# reduced rotary slice (tp_styles._mla_rope_grad).
FULL_INPUT_GRAD = {"colwise", "unit_colwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input",
                   "rowwise_rep", "mla_kv_a_proj", "replicate"}


def _hand_in(trace: _Trace, region: str | None, args, kwargs, mark: bool):
    """Hand the module a fresh view of its first input: marked as ``region``'s input at a region's entry (the
    tensor outside the region, e.g. a residual the layer keeps, is another object and stays unmarked), unmarked
    at a consumer's (what it does inside is its style's business)."""
    x = _first_input(args, kwargs)
    if x is None:
        return None
    trace.inside += 1  # the view itself is no use of the input
    try:
        y = x.view_as(x)
    finally:
        trace.inside -= 1
    if mark:
        trace.region_in[id(y)] = region
        trace.keep.append(y)
    if args and args[0] is x:
        return (y, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": y}

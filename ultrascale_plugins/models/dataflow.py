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
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..interface.meta_copy import meta_copy

LOCAL, ACTIVATION = "local", "activation"


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
    its config; anything else (a wrapper around one, such as a PEFT model, whose adapters are part of the
    architecture) is copied structurally, with its own copy of the config."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        config = copy.deepcopy(model.config)
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


def meta_inputs(seq: int) -> dict:
    """Inputs for one forward of a meta twin over ``seq`` tokens: a 4-D attention mask, so the model builds no
    mask of its own (that reads values), and explicit positions."""
    return dict(input_ids=torch.zeros(1, seq, dtype=torch.long, device="meta"),
                attention_mask=torch.zeros(1, 1, seq, seq, device="meta"),
                position_ids=torch.arange(seq, device="meta")[None], use_cache=False)


def trace_tp_locality(model: nn.Module, plan) -> tuple[set[str], set[str]]:
    """(parameters combined only with rank-local data, parameters combined with both) — plain parameters
    only: the ones the plan shards are left out. Traced on a meta-device twin of ``model``."""
    matched = plan.matches(model)
    named = dict(plan.param_matches(model))
    twin = meta_twin(model)
    sharded_owner = {fqn for fqn, style in matched.items() if style != "replicated_with_grad_allreduce"}
    planned = set(named) | {f"{m}.{p}" for m in sharded_owner for p, _ in twin.get_submodule(m).named_parameters()}
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
    inputs = meta_inputs(8)
    trace.mark([v for v in inputs.values() if isinstance(v, torch.Tensor)], ACTIVATION)
    try:
        with torch.no_grad(), trace:
            twin(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return trace.local_use - trace.replicated_use, trace.local_use & trace.replicated_use

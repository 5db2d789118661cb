"""transformers' TP style names mapped onto torch DTensor parallel styles.

transformers' own ``apply_tensor_parallelism`` always spans the whole world (it ignores a 2-D ``dp x tp`` mesh),
so this package applies torch's styles on the ``tp`` sub-mesh itself, and the styles torch lacks are written here,
built on ``distributed/local_params`` (a replicated weight whose gradient is summed over TP, Megatron's "f" and
"g"); GPT-2's packed column-parallel Conv1D weight is GPT-2's (``models/gpt2``).
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor.placement_types import _StridedShard

from ...distributed.local_params import all_reduce_backward, all_reduce_forward, run_on_local_params
from ...interface.config import ConfigError


def checkpoint_view(tensor):
    """``tensor`` as distributed checkpoint (DCP) must see it: a DTensor whose local shard holds several pieces
    of the global tensor that are not adjacent there becomes a DTensor whose local tensor lists those pieces,
    each a view of the local shard with its own global offset; any other tensor is returned as it is.

    Why: a packed parameter (``packed_colwise``/``packed_rowwise``: a fused gate|up weight, GPT-2's q|k|v) is a
    ``_StridedShard``: rank i holds ``[gate_i | up_i]``. DCP describes a DTensor's local shard as one block at
    one offset (``compute_local_shape_and_global_offset``), which for that layout is wrong: the ranks' blocks
    overlap (the save fails to validate its plan) and a load would fill ``up_i`` from the wrong rows. Listing the
    pieces is DCP's own way to save and load several chunks per rank (``LocalShardsWrapper``), so the checkpoint
    holds the plain global tensor, loadable into any layout, and a load writes into the views, that is into
    the parameter (or optimizer state) itself. Which global indices this rank holds along each dim is found by
    sharding an index vector with the tensor's own placements (``distribute_tensor`` with
    ``src_data_rank=None`` splits locally, no communication)."""
    if not isinstance(tensor, DTensor) or not any(isinstance(p, _StridedShard) for p in tensor.placements):
        return tensor
    local = tensor.to_local().detach()  # shares the parameter's storage
    runs: list[list[list[int]]] = []  # per dim: [local start, global start, length] of each contiguous piece
    for dim, size in enumerate(tensor.shape):
        placements = [p if isinstance(p, (Shard, _StridedShard)) and p.dim % tensor.ndim == dim else Replicate()
                      for p in tensor.placements]
        index = torch.arange(size, device=local.device).view([size if d == dim else 1 for d in range(tensor.ndim)])
        held = distribute_tensor(index, tensor.device_mesh, placements, src_data_rank=None).to_local().flatten()
        if len(held) != local.shape[dim] or len(held) == 0:
            return tensor  # an empty (or unexpected) shard: left to DCP's own description
        pieces: list[list[int]] = []
        for i, g in enumerate(held.tolist()):
            if pieces and g == pieces[-1][1] + pieces[-1][2]:
                pieces[-1][2] += 1
            else:
                pieces.append([i, g, 1])
        runs.append(pieces)
    if all(len(pieces) == 1 for pieces in runs):
        return tensor  # one block: DCP's description of it is right
    shards, offsets = [], []
    for combo in itertools.product(*runs):
        shard = local
        for dim, (start, _, length) in enumerate(combo):
            shard = shard.narrow(dim, start, length)
        shards.append(shard)
        offsets.append(tuple(g for _, g, _ in combo))
    # built directly, as distribute_tensor does: DTensor.from_local would take a view of the wrapper, which it
    # supports for 2-D shards only
    spec = DTensorSpec(tensor.device_mesh, tuple(tensor.placements),
                       tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype))
    return DTensor(LocalShardsWrapper(shards, offsets), spec, requires_grad=False)


def replicate_the_rest(model: nn.Module, mesh) -> None:
    """Every parameter the plan left plain (norms without sequence parallel, an embedding or head the plan does
    not shard, a Mamba mixer's convolution) becomes a replicated DTensor on the TP mesh, so that every parameter
    of a TP model is a DTensor: torch's foreach and fused optimizers (AdamW's default on GPUs, the Trainer's
    ``adamw_torch_fused``) refuse a mix of DTensors and plain tensors in one call. (With FSDP they are DTensors
    already: not called.) The model still computes on plain tensors: while a module runs, its own and its
    children's replicated parameters are seen as their local values (a module's code may use a child's parameter
    directly, as Mamba mixers use ``self.conv1d.weight``), and their gradients are kept as each rank computed
    them: these parameters see the same data on every TP rank, so the gradients are equal and summing them would
    be wrong. A parameter shared by several modules (tied weights) stays one object."""
    converted: dict[int, nn.Parameter] = {}
    owned: dict[nn.Module, list[str]] = {}  # module -> the names of its parameters converted here
    for module in model.modules():
        plain = [name for name, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        for name in plain:
            param = module._parameters[name]
            if id(param) not in converted:
                converted[id(param)] = nn.Parameter(DTensor.from_local(param, mesh, [Replicate()], run_check=False),
                                                    requires_grad=param.requires_grad)
            module.register_parameter(name, converted[id(param)])
        if plain:
            owned[module] = plain
    for module in model.modules():
        # its own and its children's: never deeper, so that no module outside an activation-checkpointed layer
        # swaps parameters inside it (a recomputation must run the same operations as the forward did)
        held = [(m, name) for m in (module, *module.children()) for name in owned.get(m, ())]
        if held:
            _run_with_local_values(module, held)


def _run_with_local_values(module: nn.Module, held: list) -> None:
    """Run ``module`` with the replicated parameters ``held`` ((owner, name): its own and its children's) swapped for
    their local values (a view: the gradient reaches the DTensor parameter as a replicated DTensor, unsummed). An enclosing
    module's swap already made them local: then nothing to do. Activation recomputation runs a layer's forward
    again, and the swap with it."""
    inner = module.forward

    def forward(*args, **kwargs):
        swapped = []
        try:
            for owner, name in held:
                param = owner._parameters.get(name)
                if isinstance(param, DTensor):
                    owner._parameters[name] = param.to_local()
                    swapped.append((owner, name, param))
            return inner(*args, **kwargs)
        finally:
            for owner, name, param in swapped:
                owner._parameters[name] = param

    module.forward = forward


# Placement of a parameter the plan names directly (fused expert weights, attention sinks), following
# transformers' meaning of each style name for parameters.
def param_placement(style: str, ndim: int):
    if style == "colwise":
        return Shard(0) if ndim == 1 else Shard(ndim - 2)
    if style == "packed_colwise":
        return Shard(ndim - 1) if ndim == 1 else _StridedShard(ndim - 2, split_factor=2)
    if style in ("rowwise", "rowwise_split_input"):
        return Replicate() if ndim == 1 else Shard(ndim - 1)
    if style == "packed_rowwise":
        return Replicate() if ndim == 1 else _StridedShard(ndim - 1, split_factor=2)
    if style in ("replicate", "replicated_with_grad_allreduce", "local_params"):
        return Replicate()
    return None


class ExpertsParallel(ParallelStyle):
    """Tensor-parallel mixture-of-experts ("moe_tp_experts"): every rank holds a slice of every expert's
    intermediate dimension (the plan shards the fused weights by parameter name), runs the experts on all
    tokens with its slices, and the partial outputs are summed over TP. The tokens and the routing weights (every
    floating-point input) are replicated inputs whose gradients are summed in backward, so the router's gradient is
    whole on every rank;
    with ``partial_input`` the tokens' gradient is left to the region (``region_input``), and with
    ``partial_output`` the sum (``PartialRowwise``)."""

    def __init__(self, partial_input: bool = False, partial_output: bool = False):
        super().__init__()
        self.partial_input, self.partial_output = partial_input, partial_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        run_on_local_params(module, device_mesh, replicate_plain=False)
        local_forward = module.forward

        def forward(hidden_states, *args, **kwargs):
            if not self.partial_input:
                hidden_states = all_reduce_backward(hidden_states, device_mesh)
            # the routing weights (top-k weights, a shared expert's gammas): whole on every rank, applied to this
            # rank's slice of the intermediate features, so their gradient is summed
            args = [all_reduce_backward(a, device_mesh) if torch.is_tensor(a) and a.is_floating_point() else a
                    for a in args]
            kwargs = {k: all_reduce_backward(v, device_mesh) if torch.is_tensor(v) and v.is_floating_point() else v
                      for k, v in kwargs.items()}
            out = local_forward(hidden_states, *args, **kwargs)
            return out if self.partial_output else all_reduce_forward(out, device_mesh)

        module.forward = forward
        return module


class LinearPackedColwise(ParallelStyle):
    """Column-parallel ``nn.Linear`` whose output packs ``split_factor`` projections (e.g. gate|up): each rank
    keeps its slice of every part (``_StridedShard``), so its local output is ``[gate_i | up_i]``. Its input's
    gradient is summed over TP here, or by its region with ``partial_input`` (see ``LocalColwise``)."""

    def __init__(self, split_factor: int, partial_input: bool = False):
        super().__init__()
        self.split_factor, self.partial_input = split_factor, partial_input

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = _StridedShard(0, split_factor=self.split_factor)
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [placement]),
                                                          requires_grad=param.requires_grad))
        run_on_local_params(module, device_mesh, replicate_plain=False)
        if not self.partial_input:
            local_forward = module.forward
            module.forward = lambda x, *a, **k: local_forward(all_reduce_backward(x, device_mesh), *a, **k)
        return module


class LocalColwise(ParallelStyle):
    """Column-parallel ``nn.Linear`` that leaves its input's gradient partial: this rank's slice of the weight
    (and bias) applied to the plain input, so the gradient it hands back covers this rank's output features only.
    Its region sums the gradients of all its projections locally and reduces them once (``region_input``), where
    torch's ``ColwiseParallel`` reduces each projection's on its own (q, k and v: three all-reduces where
    Megatron has one). The parameters are placed as ``ColwiseParallel`` places them, so checkpoints match.
    ``gather``: the output is all-gathered over its features (a head, phi3's fused qkv_proj), or with
    ``keep_dtensor`` handed on as a feature-sharded DTensor (the head under ``loss_parallel``); the gather's
    backward takes this rank's slice, so the input's gradient stays partial there too."""

    def __init__(self, gather: bool = False, keep_dtensor: bool = False):
        super().__init__()
        self.gather, self.keep_dtensor = gather, keep_dtensor

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]),
                                                          requires_grad=param.requires_grad))
        run_on_local_params(module, device_mesh, replicate_plain=False)
        if self.gather:
            local_forward = module.forward

            def forward(*args, **kwargs):
                out = DTensor.from_local(local_forward(*args, **kwargs), device_mesh, [Shard(-1)], run_check=False)
                return out if self.keep_dtensor else out.redistribute(placements=[Replicate()]).to_local()

            module.forward = forward
        return module


class PartialRowwise(RowwiseParallel):
    """Row-parallel layer whose output stays this rank's addend (a local tensor): its region adds it to the
    others (experts, a shared expert) and reduces the sum once where the region ends (Megatron's "g": one
    reduce-scatter under SP, one all-reduce under TP, where each addend reduced on its own before). The
    gradient of a partial sum is the whole gradient on every rank, which torch's ``to_local`` of a Partial
    DTensor would take as partial again: set here."""

    def __init__(self):
        super().__init__(output_layouts=Partial(), use_local_output=False)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(
            lambda m, a, out: out.to_local(grad_placements=[Replicate()]) if isinstance(out, DTensor) else out)
        return module


class LocalVocabEmbedding(ParallelStyle):
    """Vocabulary-parallel embedding computed on this rank's rows of the table (``Shard(0)``, as torch's
    ``RowwiseParallel`` places them, so checkpoints and a tied head match), zeros for the ids other ranks hold.
    Without ``reduce`` the output stays this rank's addend: the first decoder layer reduce-scatters the sum onto
    sequence shards (Megatron's embedding end under sequence parallel), where torch's style all-reduces the whole
    sequence (its ``MaskPartial`` output cannot be redistributed to anything but a replicated tensor). With
    ``reduce`` the addends are all-reduced here. Either way the weight's gradient is this rank's rows only: torch's
    embedding backward on a ``MaskPartial`` lookup hands back the whole table's gradient on every rank (most of it
    zeros), which is held until the step and reduced whole by data parallel."""

    def __init__(self, reduce: bool = False):
        super().__init__()
        self.reduce = reduce

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        vocab = module.weight.shape[0]
        start = min(device_mesh.get_local_rank() * -(-vocab // device_mesh.size()), vocab)
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)]),
                                                         requires_grad=module.weight.requires_grad))

        def forward(ids):
            table = module.weight  # this rank's rows (run_on_local_params)
            held = (ids >= start) & (ids < start + table.shape[0])
            pad = module.padding_idx
            pad = pad - start if pad is not None and start <= pad < start + table.shape[0] else None
            out = torch.nn.functional.embedding(torch.where(held, ids - start, 0), table, padding_idx=pad)
            out = out * held.unsqueeze(-1).to(out.dtype)
            return all_reduce_forward(out, device_mesh) if self.reduce else out

        module.forward = forward
        run_on_local_params(module, device_mesh, replicate_plain=False)
        return module


class VocabEmbedding(ParallelStyle):
    """A vocabulary-parallel embedding with a replicated output: torch's own lookup (``nn.Embedding.forward``,
    no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``) runs on this rank's rows (``LocalVocabEmbedding``, its
    gradient this rank's rows); a subclass whose forward does more (Gemma's scaled lookup) keeps torch's
    ``RowwiseParallel``, which runs the module's own forward."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        plain = (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
                 and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse)
        style = (LocalVocabEmbedding(reduce=True) if plain
                 else RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        return style._apply(module, device_mesh)


class ForwardHookStyle(ParallelStyle):
    """A style that only transforms the module's output (or input) with a function of (module, mesh, x)."""

    def __init__(self, fn, on_input: bool = False):
        super().__init__()
        self.fn, self.on_input = fn, on_input

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if self.on_input:
            module.register_forward_pre_hook(
                lambda m, args: (self.fn(m, device_mesh, args[0]), *args[1:]) if args else args)
        else:
            module.register_forward_hook(lambda m, args, out: self.fn(m, device_mesh, out))
        return module


class LocalParams(ParallelStyle):
    """The module's own parameters are used as local tensors in forward ("local_params", e.g. an attention
    module whose sinks the plan shards by heads); plain ones are replicated with summed gradients."""

    def __init__(self, replicate_plain: bool):
        super().__init__()
        self.replicate_plain = replicate_plain

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        run_on_local_params(module, device_mesh, replicate_plain=self.replicate_plain)
        return module


def _mla_rope_grad(module, mesh, out):
    """DeepSeek-style latent attention: the rotary part of ``kv_a_proj_with_mqa``'s output bypasses the
    column-parallel ``kv_b_proj`` and meets this rank's heads only, so its gradient is summed over TP."""
    rope = module.qk_rope_head_dim  # set by dims.tensor.plugin from the model config
    keep, rot = out.split([out.shape[-1] - rope, rope], dim=-1)
    return torch.cat([keep, all_reduce_backward(rot, mesh)], dim=-1)


def takes_partial_input(name: str, extra: dict[str, Callable] | None = None) -> bool:
    """Has the style a variant that leaves its input's gradient partial (``make_style(partial_input=True)``)? A
    plugin's style factory says so with a ``partial_input`` attribute: a factory of that variant."""
    if extra and name in extra:
        return callable(getattr(extra[name], "partial_input", None))
    return name in PARTIAL_INPUT_STYLES


PARTIAL_INPUT_STYLES = {"colwise", "unit_colwise", "packed_colwise", "moe_tp_experts", "colwise_gather_output",
                        "colwise_rep"}


def make_style(name: str, *, sequence_parallel: bool, loss_parallel: bool, is_head: bool,
               extra: dict[str, Callable] | None = None, shard_output: bool = True,
               partial_input: bool = False, partial_output: bool = False) -> ParallelStyle:
    """Build the torch ParallelStyle for a transformers style name, adjusted for sequence/loss parallel.

    Under sequence parallel a region's input is gathered by the region itself (see dims.tensor.plugin), so layers
    inside take a replicated input; a row-parallel layer reduce-scatters its output back to sequence shards
    when it ends its region (``shard_output``), and all-reduces it otherwise (the region then slices).
    ``partial_input``: a column-parallel layer whose region reduces its input's gradient (``region_input``);
    ``partial_output``: a row-parallel layer (or TP experts) whose region sums its output (``PartialRowwise``)."""
    if extra and name in extra:
        factory = extra[name].partial_input if partial_input else extra[name]
        return factory(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if partial_input and name in ("colwise", "unit_colwise"):
        return LocalColwise()
    seq = Shard(1)
    row_out = seq if sequence_parallel and shard_output else Replicate()
    if name in ("colwise", "unit_colwise"):  # unit_*: transformers' head-aligned styles; with heads divisible by
        return ColwiseParallel()              # tp (checked before launch) they are the plain ones
    if name in ("colwise_gather_output", "colwise_rep"):
        if partial_input:
            return LocalColwise(gather=True, keep_dtensor=is_head and loss_parallel)
        if is_head and loss_parallel:
            return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise", "unit_rowwise"):
        return PartialRowwise() if partial_output else RowwiseParallel(output_layouts=row_out)
    if name in ("rowwise_split_input", "rowwise_rep"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=row_out)
    if name in ("embedding_rowwise", "vocab_parallel_embedding") and partial_output:
        return LocalVocabEmbedding()
    if name in ("embedding_rowwise", "vocab_parallel_embedding"):
        # Output replicated even under SP: the first decoder layer splits the sequence (see dims.tensor.plugin),
        # so the model still builds its masks and positions on the full sequence.
        return VocabEmbedding()
    if name == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "replicated_with_grad_allreduce":
        return LocalParams(replicate_plain=True)
    if name == "local_params":
        return LocalParams(replicate_plain=False)
    if name == "replicate":  # stays a plain tensor, used whole: its gradient is whole on every rank
        return LocalParams(replicate_plain=False)
    if name == "moe_tp_experts":
        return ExpertsParallel(partial_input=partial_input, partial_output=partial_output)
    if name == "packed_colwise":  # a Linear whose output packs two projections (gate|up)
        return LinearPackedColwise(split_factor=2, partial_input=partial_input)
    if name == "moe_identity_expert":  # an identity expert's output is summed over TP with the others: pre-divide
        return ForwardHookStyle(lambda m, mesh, x: x / mesh.size(), on_input=True)
    if name == "all_reduce":
        return ForwardHookStyle(lambda m, mesh, x: all_reduce_forward(x, mesh) if torch.is_tensor(x) else x)
    if name == "mla_kv_a_proj":
        return ForwardHookStyle(_mla_rope_grad)
    if name == "sequence_parallel":
        return LocalParams(replicate_plain=True)
    usable = sorted(KNOWN_STYLES - PARAM_ONLY_STYLES)
    raise ConfigError(f"tp plan style '{name}' is not supported on a module. Fix: use one of {', '.join(usable)}, "
                      "or register a plugin whose ultrascale_declare_model_plan supplies a style of that name")


PARAM_ONLY_STYLES = {"packed_rowwise"}  # placements of parameters the plan names (param_placement), no module style
KNOWN_STYLES = {"colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep",
                "embedding_rowwise", "vocab_parallel_embedding", "embedding_colwise", "replicated_with_grad_allreduce",
                "local_params", "replicate", "moe_tp_experts", "moe_identity_expert", "all_reduce", "mla_kv_a_proj",
                "sequence_parallel", "packed_colwise", "packed_rowwise", "unit_colwise", "unit_rowwise"}


def redistribute_first_input(mesh, src, dst, grad=None) -> Callable:
    """A forward pre-hook that moves the module's first input (positional, or ``hidden_states=``) from
    placement ``src`` to ``dst`` and hands the module a local tensor, whose gradient the backward takes as
    placed ``grad`` (default: ``dst``). Written here because torch's PrepareModuleInput must be told whether an
    input arrives positionally or by keyword, and Hugging Face calls decoder layers positionally but attention
    modules by keyword."""

    def convert(x):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [src], run_check=False)
        if tuple(x.placements) != (dst,):
            x = x.redistribute(placements=[dst])
        return x.to_local(grad_placements=[grad] if grad is not None else None)

    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (convert(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}
        return args, kwargs

    return hook


def region_input(mesh, sequence_parallel: bool) -> Callable:
    """The forward pre-hook of a region whose every consumer of its input leaves that input's gradient partial
    (``models.dataflow``: column-parallel layers only): Megatron's "f" once per region. Forward: nothing (TP) or
    an all-gather of the sequence shards (SP); backward: one all-reduce (TP) or reduce-scatter (SP) of the sum of
    the projections' partial gradients."""
    return redistribute_first_input(mesh, Shard(1) if sequence_parallel else Replicate(), Replicate(), Partial())


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_input_grad(factor: float) -> Callable:
    """A forward pre-hook: the module's first input unchanged, its gradient times ``factor``. For a module that
    reads a region's input and hands back a whole gradient (a router, a replicated adapter): the region sums
    the gradients of all its readers over TP once, so this one's enters that sum divided by tp."""

    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            return (_ScaleGrad.apply(args[0], factor), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": _ScaleGrad.apply(kwargs["hidden_states"], factor)}
        return args, kwargs

    return hook


def redistribute_output(mesh, src, dst, grad=None) -> Callable:
    """A forward hook that moves a module's (local tensor) output — or the first element of a tuple output —
    from placement ``src`` to ``dst``; the backward takes the gradient as placed ``grad`` (default: ``dst``)."""

    def convert(output):
        x = output if isinstance(output, DTensor) else DTensor.from_local(output, mesh, [src], run_check=False)
        return x.redistribute(placements=[dst]).to_local(grad_placements=[grad] if grad is not None else None)

    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            return convert(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):  # (hidden_states, ...)
            return (convert(output[0]), *output[1:])
        return output

    return hook

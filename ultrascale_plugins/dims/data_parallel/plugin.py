"""Data parallel: ZeRO-3 / ZeRO-2 / HSDP through FSDP2 ``fully_shard``, ZeRO-1 and plain replication through DDP
(plus ``ZeroRedundancyOptimizer`` for ZeRO-1), and mixed precision.

Over tensor-parallel (DTensor) parameters, which neither DDP nor ``ZeroRedundancyOptimizer`` can hold: ZeRO-1 runs
on FSDP2 sharded over every data-parallel rank, its parameters kept gathered and its gradients reduced once per
optimizer step (``grad_sync: step``), which is ZeRO-1's memory and communication with the optimizer states sharded
as DTensors (fused and foreach AdamW run on them); ZeRO-0 leaves the gradients to the engine, which averages them
over the data-parallel axes in one flat all-reduce after a step's last backward (as it already does for pipeline
stages). Why not torch's own "DDP over DTensors": its composable ``replicate`` built on FSDP2
(``torch.distributed._composable.replicate_with_fsdp``) exists at the torch 2.11 floor but is private and changed
shape between 2.10 and 2.13, and ``fully_shard`` over a (replicate, shard=1) mesh needs a degree-1 mesh axis and
keeps a second, unsharded copy of every parameter; the engine's all-reduce moves the same bytes with neither.

FSDP2 groups: one per decoder layer and one at the root. The root group holds the embedding, the final norm
and the head, so a tied embedding/head parameter lives in exactly one group (torch rejects a parameter shared
by two groups).

Across a step's micro-batches (gradient accumulation, or a pipeline's), ``grad_sync`` chooses: ``micro_batch``
reduce-scatters every micro-batch's gradients (they accumulate sharded; ZeRO-3 re-gathers the weights for every
forward and backward, ZeRO-2 keeps them gathered over the step), ``step`` holds every whole fp32 gradient over the
step and reduces once, after the last micro-batch, with the weights gathered once for the step.
"""
from __future__ import annotations

import re

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ...interface.config import ConfigError, field_error
from ...interface.hookspecs import hookimpl
from ...interface.facts import layout_facts
from ...interface.fake_values import fake_mode_of
from ...interface.stages import Stage, step
from ...interface.mesh_axes import MeshAxis
from ...interface.parallel_dims import ParallelDims
from .costs import grad_sync, layout_facts_of

DTYPES = {"bf16": torch.bfloat16}


def _dp_shard(value):
    if value == 0 or value < -1:
        return "must be positive, or -1 for the rest of the world", "use dp_shard: -1"
    return None


def _precision(value):
    if value == "fp16":
        return ("fp16 needs a loss scaler over sharded gradients, which is not available yet",
                "use mixed_precision: bf16")
    return None


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("dp_replicate", int, 1, "replicated data-parallel degree (HSDP's replica groups)", minimum=1,
               ask="Replicated data-parallel degree, HSDP")
    fields.add("dp_shard", int, -1, "sharded data-parallel degree; -1 = the rest of the world", check=_dp_shard)
    fields.add("zero_stage", int, 3, "3: parameters, gradients and optimizer states sharded (FSDP2); 2: gradients "
               "and optimizer states; 1: optimizer states (DDP + ZeroRedundancyOptimizer; over tensor-parallel parameters "
               "FSDP2, gathered for the step and reduced once); 0: plain DDP (over tensor-parallel parameters one "
               "all-reduce per step)",
               choices=(0, 1, 2, 3), ask="ZeRO stage of the sharded data-parallel rest")
    for way, default in (("forward", "none: each layer's all-gather is issued when the layer starts"),
                         ("backward", "one layer, implicitly")):
        fields.add(f"fsdp_{way}_prefetch", int, 0, f"FSDP2: how many layers ahead each layer's {way} issues the "
                   f"next layers' all-gathers (explicit prefetch: more overlap, more memory); 0 = FSDP2's default "
                   f"({default})", minimum=0)
    fields.add("grad_sync", str, "auto", "when data parallel reduces the gradients of a step's micro-batches "
               "(gradient accumulation, or a pipeline's): micro_batch: after each (FSDP2 reduce-scatters, gradients "
               "accumulate sharded); step: once, after the last (every whole fp32 gradient held over the step, the "
               "weights gathered once); auto: step for zero_stage 0 and 1 and inside a pipeline, else micro_batch",
               choices=("auto", "micro_batch", "step"), auto=grad_sync)
    fields.add("mixed_precision", str, "no", "bf16: compute in bfloat16, reduce and keep weights in fp32",
               choices=("no", "bf16", "fp16"), check=_precision, ask="Mixed precision", words=str)
    fields.add("param_dtype", str, "fp32", "the dtype the weights, their gradients and the optimizer states are held "
               "in: fp32, or bf16 (everything bfloat16, torchtune's dtype: bf16; half the bytes, pair it with a "
               "stochastic-rounding optimizer so small updates are not lost)", choices=("fp32", "bf16"))
    fields.add("cpu_offload", bool, False, "ZeRO-2/3: hold the sharded weights, their gradients and the optimizer "
               "states in host memory (FSDP2's CPUOffloadPolicy): each group's weights are copied to the device for "
               "its forward and backward, its gradients back after their reduce-scatter, and the optimizer steps "
               "on the CPU", dry_run="the dry run holds every tensor in one memory, so host and device are one")
    # the facts this plugin decides for the others (answered in ultrascale_declare_facts), with their defaults
    fields.fact("fsdp_units", False, "each block is an FSDP2 unit of its own (ZeRO-2/3), so modules in a mesh view "
                                     "get FSDP2 groups over the view's axes")
    fields.fact("fsdp_shards", 1, "how many row shards FSDP2 cuts a block's parameters into (1: held whole)")
    fields.fact("states_sharded", False, "FSDP2 holds the gradients or optimizer states sharded (ZeRO-2/3 over more "
                                         "than one rank, or ZeRO-1 over tensor-parallel parameters)")
    fields.fact("grad_reduce", "step", "when gradients are reduced: step (once, after a step's last backward) or "
                                       "micro_batch (after every backward, so each backward's gradients must be "
                                       "complete when it ends)")
    fields.fact("compute_bytes", 4, "bytes of an activation element (2 under bf16 compute)")
    fields.fact("param_bytes", 4, "bytes of a weight element as held, and of its gradient and optimizer states (2: "
                                  "bf16)")
    fields.fact("params_on_host", False, "the parameters' shards live in host memory, the device holds only what a "
                                         "step gathers; a meta-device build gives them host storage")


@hookimpl
def ultrascale_declare_facts(config, degrees):
    return layout_facts_of(config, degrees)


@hookimpl
def ultrascale_declare_mesh_axes(config):
    # inside the pipeline's stages; dp_shard inside dp_replicate (HSDP: shards within a replica)
    stage = config.zero_stage
    return [MeshAxis("dp_replicate", config.dp_replicate, after="pp", splits_rows=True, reduces_grads=True,
                     counts_tokens=True),
            MeshAxis("dp_shard", config.dp_shard, after="dp_replicate", splits_rows=True, reduces_grads=True,
                     counts_tokens=True, says="zero_stage",
                     words="(plain data parallel: DDP, a whole copy per rank)" if stage == 0 else f"(ZeRO-{stage})")]


@hookimpl
def ultrascale_transform_stages(config, model_config):
    axes = tuple(a for a in ("dp_replicate", "dp_shard") if getattr(config, a) != 1)
    return [Stage("param_dtype", cast_parameters, before=("split",), active=config.param_dtype != "fp32",
                  does=f"every weight held in {config.param_dtype} (gradients and optimizer states follow)"),
            Stage("dp", wrap_model, after=("compile",), axes=axes, does=_wrapping(config))]


def cast_parameters(model, ctx):
    """Every floating-point parameter in ``param_dtype``, in place (tied ones stay one), on the whole model before
    any transform, so every dimension shards and reduces the weights as they are held; buffers (rotary tables)
    keep theirs, and so do the modules the model keeps in fp32 (transformers' ``_keep_in_fp32_modules``)."""
    dtype = {"bf16": torch.bfloat16}.get(ctx.config.param_dtype)
    if dtype is None:
        return
    keep = set()
    for sub in model.modules():
        keep.update(getattr(sub, "_keep_in_fp32_modules", None) or ())
        keep.update(getattr(sub, "_keep_in_fp32_modules_strict", None) or ())
    for name, param in model.named_parameters():
        kept = any(re.search(rf"(^|\.){re.escape(k)}($|\.)", name) for k in keep)  # a name or a dotted path
        if param.is_floating_point() and param.dtype != dtype and not kept:
            param.data = param.data.to(dtype)


def _wrapping(config) -> str:
    dims = ParallelDims(config)
    dp = dims.degree("dp_replicate") * dims.degree("dp_shard")
    if dims.facts.states_sharded:
        how = f"FSDP2 over {dp} ranks (ZeRO-{config.zero_stage})"
    elif dp > 1:
        how = f"replicated over {dp} ranks (ZeRO-{config.zero_stage}), gradients averaged"
    else:
        how = "one data-parallel rank: nothing to wrap"
    return how + ("" if config.mixed_precision == "no" else f", {config.mixed_precision} compute")


def wrap_model(model, ctx):
    dims, cfg = ctx.dims, ctx.config
    dtype = DTYPES.get(cfg.mixed_precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    # ZeRO-3 reshards each layer after its forward (and gathers it again for the backward) only when gradients are
    # reduced every micro-batch; reduced once per step (a pipeline's default, as torchtitan does) the weights stay
    # gathered for the step: one all-gather per step, not two per micro-batch
    reshard = cfg.zero_stage == 3 and cfg.grad_sync == "micro_batch"
    ctx.on_forward_only(reshard_gathered)
    offload = offload_policy(cfg, ctx.device)
    if cfg.zero_stage >= 2:
        shard_view_modules(model, ctx, reshard, policy, offload)
    if dims.facts.states_sharded or cfg.cpu_offload:
        mesh = fsdp_mesh(ctx)
        groups = fsdp_groups(model, ctx.plan_layers(model))
        for fqn in uniform_dtype_groups(model, groups):  # inside the groups they split: wrapped first
            fully_shard(model.get_submodule(fqn), mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                        offload_policy=offload, shard_placement_fn=beside_strided_rows)
        layers = [model.get_submodule(fqn) for fqn in groups]
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload,
                        shard_placement_fn=beside_strided_rows)
        prefetch(layers, cfg.fsdp_forward_prefetch, cfg.fsdp_backward_prefetch)
        # The root's parameters are used first in backward, so keeping them unsharded after forward saves an
        # all-gather at no real memory cost.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload,
                    shard_placement_fn=beside_strided_rows)
        if dims.enabled("pp") and cfg.grad_sync == "micro_batch":
            reduce_every_micro_batch(model, reshard)
        ctx.claim_grad_reduction("dp_replicate", "dp_shard")
        return
    if dtype is not None:
        ctx.autocast_dtype = dtype
    dp_mesh = ctx.sub_mesh(("dp_replicate", "dp_shard"))
    if dp_mesh is None or len(ctx.modules) > 1 or dims.enabled("pp") or holds_dtensors(model):
        # Pipeline stages: DDP's reducer miscounts parameters under the schedule's per-micro-batch no_sync (torch
        # 2.13: "rebuilt parameter indices size is not same"); tensor-parallel (DTensor) parameters: DDP cannot hold
        # them. The engine averages their gradients after a step's last backward instead, in one flat all-reduce
        # (these axes stay unclaimed).
        return
    if not any(p.requires_grad for p in model.parameters()):
        ctx.materialize()  # a frozen model (a trainer's reference): no gradient to reduce, replicas as they are
        return
    ctx.materialize()  # DDP broadcasts rank 0's parameters when it wraps the model: they must exist
    in_views = [f"{fqn}.{name}" for fqn in ctx.view_modules(model)
                for name, _ in model.get_submodule(fqn).named_parameters()]
    if in_views:  # their own FSDP groups (or the engine) reduce them, over their view's axes
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, in_views)
    with fake_mode_of(model):  # a dry run's fake weights: the reducer's buckets fake too, not host memory
        ctx.forward_module = DistributedDataParallel(model, process_group=dp_mesh.get_group(),
                                                     device_ids=[ctx.device.index] if ctx.device.type == "cuda"
                                                     else None)
    ctx.claim_grad_reduction("dp_replicate", "dp_shard")


def offload_policy(config, device) -> OffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy`` under ``cpu_offload`` (page-locked host memory only beside a GPU: pinning needs
    one, and gloo's CPU tensors gain nothing from it), else FSDP2's default (no offload)."""
    if not config.cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def fsdp_mesh(ctx):
    """ZeRO-2/3: dp_shard, or (dp_replicate, dp_shard) for HSDP (FSDP2 replicates over the first mesh dim and shards
    over the second). ZeRO-1 over DTensors: every data-parallel rank flattened into one axis, so the optimizer states
    are partitioned over all of them, as ``ZeroRedundancyOptimizer`` partitions them."""
    dims = ctx.dims
    if ctx.config.zero_stage == 1:
        return ctx.sub_mesh(("dp_replicate", "dp_shard"))
    if not dims.enabled("dp_shard"):  # cpu_offload on one data-parallel rank: FSDP2 groups that shard nothing
        from ...interface.mesh import unit_mesh

        return unit_mesh(ctx.device.type, "dp_shard", ctx.dims.timeout)
    return ctx.mesh[("dp_replicate", "dp_shard")] if dims.enabled("dp_replicate") else ctx.mesh["dp_shard"]


def holds_dtensors(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def reduce_every_micro_batch(stage, reshard: bool) -> None:
    """A pipeline stage with ``grad_sync: micro_batch``. torch's ``PipelineStage`` turns an FSDP2 stage's gradient
    reduction and its resharding off before every micro-batch's backward (``set_requires_gradient_sync``,
    ``set_reshard_after_backward``, ``set_is_last_backward``) and runs both once after the last (``post_backward``).
    Its calls on this stage's root that would defer the reduction are made no-ops here, so FSDP2 reduce-scatters
    after every micro-batch's backward as it does outside a pipeline (its own hooks); with ``reshard`` (ZeRO-3) the
    weights are resharded after each too, else (ZeRO-2) the stage's closing ``post_backward`` reshards them, once.
    It finds no gradient left to reduce. ``no_sync`` still sets the flags (through the class)."""
    names = ["set_requires_gradient_sync", "set_is_last_backward"] + (["set_reshard_after_backward"] if reshard else [])
    for name in names:
        object.__setattr__(stage, name, _ignored)


def _ignored(*args, **kwargs) -> None:
    return None


@hookimpl
def ultrascale_step_no_sync(pmodel):
    """Gradient accumulation, before a step's last micro-batch. DDP's all-reduce and HSDP's all-reduce over the
    replicas wait for the last backward. FSDP2: with ``grad_sync: micro_batch`` its reduce-scatters still run after
    every micro-batch's backward, so gradients accumulate sharded; with ``step`` they wait too (every whole fp32
    gradient held until the last micro-batch). Weights that stay gathered over the step (ZeRO-2, or ``step``) are
    not resharded after these backwards, so the next forward gathers nothing; the last backward reshards them."""
    import contextlib

    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in pmodel.modules if isinstance(m, FSDPModule)]
    ddp = pmodel.forward_module if isinstance(pmodel.forward_module, DistributedDataParallel) else None
    if not fsdp and ddp is None:
        return None
    cfg = pmodel.config
    once = cfg.grad_sync == "step"
    gathered = once or cfg.zero_stage < 3

    @contextlib.contextmanager
    def local():
        for m in fsdp:
            FSDPModule.set_requires_all_reduce(m, False)
            if once:
                FSDPModule.set_requires_gradient_sync(m, False)
            if gathered:
                FSDPModule.set_reshard_after_backward(m, False)
        try:
            with (ddp.no_sync() if ddp is not None else contextlib.nullcontext()):
                yield
        finally:
            for m in fsdp:
                FSDPModule.set_requires_gradient_sync(m, True)  # the reduce-scatter and the replicas' all-reduce
                FSDPModule.set_reshard_after_backward(m, True)

    return local()


def beside_strided_rows(param):
    """FSDP2's shard of a parameter whose tensor-parallel shard is strided over its rows (a packed gate|up
    Linear: each TP rank holds its slice of both halves): its columns. FSDP's default row shard nested in a strided
    row shard came out of the optimizer step wrong (torch 2.13: the gradient of nested strided shards on one dim is
    mis-placed); on different dims the two shards are independent. Every other parameter: FSDP's default."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = any(isinstance(p, _StridedShard) and p.dim == 0 for p in getattr(param, "placements", ()))
    return Shard(1) if strided and param.ndim > 1 else None


def shard_view_modules(model, ctx, reshard: bool, policy, offload) -> None:
    """The modules the plan puts in a mesh view (``ModelPlan.views``: experts under expert parallelism) get FSDP2
    groups of their own over the view's gradient axes (the last one sharded, one before it replicated: HSDP),
    before the layers around them are wrapped. Their gradients are summed there and divided by the layout's loss
    scale, not averaged over the view's ranks, which hold other tokens' contributions than the layout's."""
    from torch.distributed.tensor import Shard

    dims = ctx.dims
    for fqn, view in sorted(ctx.view_modules(model).items()):
        axes = dims.view_grad_axes(view)
        if not axes or len(axes) > 2:
            raise ConfigError(f"mesh view '{view}' has gradient axes {axes}: FSDP2 shards over one axis and replicates "
                              "over at most one more. Fix: give the view one or two gradient axes")
        mesh = dims.view_mesh(view)[axes if len(axes) == 2 else axes[0]]
        shards = dims.degree(axes[-1])

        def placement(param, shards=shards):  # few rows (experts per rank) vs many ranks: split the next dim
            local = param.to_local() if hasattr(param, "to_local") else param
            return Shard(1) if local.dim() > 1 and local.shape[0] % shards else Shard(0)

        module = model.get_submodule(fqn)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload,
                    shard_placement_fn=placement)
        module.set_gradient_divide_factor(float(dims.grad_scale))
        # a sum, then the division: a divisor other than the group's size is NCCL's PreMulSum, which gloo lacks.
        # (Not on one rank: torch 2.13 then divides twice, once in the copy that stands for the reduce-scatter.)
        module.set_force_sum_reduction_for_comms(shards > 1)
        ctx.claim_grad_reduction(*axes, view=view, divisor=float(dims.grad_scale))


def prefetch(layers: list, forward: int, backward: int) -> None:
    """Explicit FSDP2 prefetch: layer i's forward issues the all-gathers of layers i+1..i+forward, its backward
    those of layers i-1..i-backward (the order backward runs them). FSDP2 alone overlaps an all-gather with
    compute only as far as the CPU runs ahead of the device (forward) or one layer (backward); a CPU-bound step
    (small layers, many ranks) gains from going further, at the memory of that many more unsharded layers."""
    for i, layer in enumerate(layers):
        if forward:
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + forward])
        if backward:
            layer.set_modules_to_backward_prefetch(layers[max(0, i - backward):i][::-1])


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    if config.param_dtype == "bf16" and config.mixed_precision != "no":
        raise field_error("mixed_precision", config.mixed_precision, "param_dtype=bf16 holds the weights in bf16, "
                          "so there are no fp32 master weights for mixed precision to keep",
                          "set mixed_precision: no (the compute is bf16 already), or param_dtype: fp32")
    if config.cpu_offload:
        refused = offload_refusal(config)
        if refused is not None:
            raise field_error("cpu_offload", True, *refused)
    if config.zero_stage <= 1 and config.grad_sync == "micro_batch":
        raise field_error("grad_sync", config.grad_sync, f"zero_stage={config.zero_stage} reduces gradients once per "
                          "step (whole gradients on every rank: DDP's all-reduce, ZeRO-1's partition)",
                          "use zero_stage: 2 or 3 to reduce (reduce-scatter) every micro-batch, or grad_sync: step")
    if config.zero_stage >= 2:
        return
    for view in config.registry.views(config):  # a view's modules are sharded by FSDP2 over the view's own axes
        own = [a for a in view.axes if not a.reduces_grads and a.degree != 1]
        raise field_error("zero_stage", config.zero_stage, f"{', '.join(f'{a.name}={a.degree}' for a in own)} shards "
                          f"the {view.name} in FSDP2 groups of their own, which zero_stage 0 and 1 (DDP, ZeRO-1) do "
                          "not use", "use zero_stage: 2 or 3, or " + ", ".join(f"{a.name}: 1" for a in own))
    for way in ("forward", "backward"):
        value = getattr(config, f"fsdp_{way}_prefetch")
        if value:
            raise field_error(f"fsdp_{way}_prefetch", value, f"prefetches FSDP2's all-gathers, and zero_stage="
                              f"{config.zero_stage} does not use FSDP2", "use zero_stage: 2 or 3, or leave it 0")


def offload_refusal(config) -> tuple[str, str] | None:
    """Why this layout cannot hold its shards on the host (``cpu_offload``), as (reason, fix), or None when it can:
    the validation's refusal and the planner's offer ask the same question."""
    if config.zero_stage < 2:
        return (f"offloads FSDP2's shards to host memory, and zero_stage={config.zero_stage} does not use FSDP2",
                "use zero_stage: 2 or 3, or cpu_offload: false")
    if config.dp_shard == 1 and layout_facts(config).degree("tp") > 1:
        return ("tensor parallel with one data-parallel rank: FSDP2 needs a data-parallel axis of the layout's "
                "mesh to hold tensor-parallel shards", "use dp_shard: 2 or more beside tp, or cpu_offload: false")
    if config.dp_replicate > 1 and config.dp_shard == 1:
        return (f"dp_replicate={config.dp_replicate} with dp_shard=1 replicates whole weights (DDP), which FSDP2's "
                "offload does not hold", "shard them: dp_shard: -1 (ZeRO-3), or cpu_offload: false")
    return None


def reshard_gathered(modules) -> None:
    """Free the parameters FSDP2 holds gathered after a forward-only pass (a pipeline's evaluation: its stages keep
    them gathered between micro-batches, ``reshard_after_forward=False``, and no backward releases them)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()


def fsdp_groups(model, layers: list[str]) -> list[str]:
    """The layers that get an FSDP group of their own: the outermost of nested ones (Mamba's block holds its
    mixer, both "no split" modules), and none whose parameters are shared with a module outside it (an encoder
    used as a decoder lists its embeddings, whose weight the head ties): those stay in the root's group, as
    torch requires of a shared parameter."""
    chosen = [fqn for fqn in layers if not any(fqn.startswith(other + ".") for other in layers if other != fqn)]
    owners: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name)

    def shared_outside(fqn: str) -> bool:
        inside = fqn + "."
        return any(any(not n.startswith(inside) for n in owners[id(p)]) for p in model.get_submodule(fqn).parameters())

    return [fqn for fqn in chosen if not shared_outside(fqn)]


def uniform_dtype_groups(model, groups: list[str]) -> list[str]:
    """Modules that get an FSDP group of their own so that every group's trainable parameters share one dtype,
    which FSDP2 requires (a frozen bf16 base may sit beside fp32 adapters, but PEFT's trained bf16 copy of the
    head beside fp32 LoRA on the embedding may not): in each group (a layer, or what the root keeps), the trainable
    parameters of every dtype but the most common one go, with the smallest module around them that the model
    calls (not a ModuleDict or ParameterDict), into a group of their own. Raises ``ConfigError`` when such a
    module also holds trainable parameters of another dtype, or shares a parameter outside itself."""
    from torch import nn

    owners: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name)
    extra: list[str] = []
    for group in groups + [""]:
        inner = [g for g in groups if group == "" or g.startswith(group + ".")]
        inner = [g for g in inner if g != group]
        root = model.get_submodule(group)
        trained = [(f"{group}.{n}" if group else n, p) for n, p in root.named_parameters() if p.requires_grad]
        trained = [(n, p) for n, p in trained if not any(n.startswith(g + ".") for g in inner)]
        size: dict = {}
        for _, p in trained:
            size[p.dtype] = size.get(p.dtype, 0) + p.numel()
        if len(size) < 2:
            continue
        keep = max(size, key=size.get)
        found = set()
        for name, p in trained:
            if p.dtype == keep:
                continue
            fqn = name.rpartition(".")[0]
            while fqn != group and isinstance(model.get_submodule(fqn), (nn.ModuleDict, nn.ParameterDict,
                                                                           nn.ModuleList)):
                fqn = fqn.rpartition(".")[0]
            if fqn == group:
                raise ConfigError(f"'{group or 'the model'}' holds trainable parameters of dtypes "
                                  f"{sorted(str(d) for d in size)} directly, and FSDP2 needs one dtype per group. "
                                  "Fix: give every trainable parameter one dtype (e.g. model.float())")
            found.add(fqn)
        for fqn in sorted(found):
            if any(fqn.startswith(other + ".") for other in found):
                continue
            module = model.get_submodule(fqn)
            dtypes = {str(p.dtype) for p in module.parameters() if p.requires_grad}
            shared = [n for p in module.parameters() for n in owners[id(p)] if not n.startswith(fqn + ".")]
            if len(dtypes) > 1 or shared:
                raise ConfigError(f"'{fqn}' holds trainable parameters of dtype(s) {sorted(dtypes)} that differ from "
                                  f"the rest of its FSDP group" + (f" and shares '{shared[0]}'" if shared else "")
                                  + ", and FSDP2 needs one dtype per group. Fix: give every trainable parameter "
                                  "one dtype (e.g. model.float(), or PEFT's autocast_adapter_dtype)")
            extra.append(fqn)
    return extra


@hookimpl
def ultrascale_validate_model(model, plan, config):
    """A model whose trainable parameters have several dtypes is checked before launch: FSDP2 needs one per
    group (``uniform_dtype_groups``). Modules in a mesh view need FSDP2 (zero_stage 2 or 3): ZeRO-1's optimizer
    would broadcast them from ranks that hold other ones."""
    if plan is not None and plan.views and config.zero_stage < 2:
        fqn, view = next(iter(sorted(plan.views.items())))
        raise field_error("zero_stage", config.zero_stage, f"'{fqn}' is data-parallel in mesh view '{view}' "
                          "(sharded by FSDP2 over its own axes), which zero_stage 0 and 1 do not do",
                          "use zero_stage: 2 or 3")
    if config.zero_stage >= 2 and plan is not None and len({p.dtype for p in model.parameters() if p.requires_grad}) > 1:
        from ...models.plan import layers_present

        uniform_dtype_groups(model, fsdp_groups(model, layers_present(model, plan)))


@hookimpl
def ultrascale_step_optimizer(pmodel, optimizer):
    group = pmodel.dims.group(("dp_replicate", "dp_shard"))
    if pmodel.config.zero_stage != 1 or group is None or pmodel.dims.facts.states_sharded:  # ZeRO-1 on FSDP2: sharded already
        return None
    return partitioned(optimizer, group)


@hookimpl
@step("dp")
def ultrascale_cost_estimate(config, model_config, shape, estimate):
    """At "dp", after the other dimensions: shards what the pipeline and tensor parallel left this rank."""
    from .costs import data_parallel_terms

    data_parallel_terms(config, shape, estimate)


@hookimpl
def ultrascale_cost_comm_minimum(config, shape):
    """The least communication of a step's gradients and weights over the axes that reduce gradients
    (``dp_replicate``, ``dp_shard``, ``cp``; a view's ``efsdp``) (``minimum``)."""
    from .minimum import data_parallel_minimum

    return data_parallel_minimum(config, shape)


def partitioned(optimizer, group):
    """ZeRO-1: a ``ZeroRedundancyOptimizer`` of the same class and settings as ``optimizer`` over ``group``."""
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer

    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # defaults may hold derived keys
    # every group with its own settings (Trainer's default optimizer has two: with and without weight decay), of
    # the parameters that train: a frozen one (a PEFT model's base) would be given an owner that broadcasts it
    # after every step, and would skew the partition of the states
    groups = [{"params": [p for p in g["params"] if p.requires_grad],
               **{k: v for k, v in g.items() if k in settings and v != settings[k]}}
              for g in optimizer.param_groups]
    groups = [g for g in groups if g["params"]]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=group, **settings)


@hookimpl
def ultrascale_cost_search(config, model_config, world_size):
    """Memory savers, tried only when nothing fits without them: offload (the same numbers; host memory, the host
    link's time, the optimizer on the CPU), for the candidates that run it; then, lossy, bf16 weights, gradients and
    optimizer states (half the bytes; other numbers: pair them with stochastic rounding) where the compute is bf16
    already."""
    from ...interface.search_offer import SearchOffer

    offloads = not config.cpu_offload and offload_refusal(config) is None
    halves = config.param_dtype == "fp32" and config.mixed_precision == "bf16"
    return SearchOffer(savers={"cpu_offload": [True]} if offloads else {},
                       lossy={"param_dtype": ["bf16"]} if halves else {})


@hookimpl
def ultrascale_declare_presets():
    from ...interface.presets import Preset

    return [Preset("zero3", "ZeRO-3 (FSDP2) over every device",
                   lambda world, per_node, mc: {"dp_shard": world, "zero_stage": 3}),
            Preset("zero2", "ZeRO-2 (FSDP2, parameters kept whole) over every device",
                   lambda world, per_node, mc: {"dp_shard": world, "zero_stage": 2})]


@hookimpl
def ultrascale_declare_accelerate_keys():
    return {"dp_replicate_size": ("dp_replicate", {}), "dp_shard_size": ("dp_shard", {})}

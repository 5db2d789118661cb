"""Tensor parallel and Megatron-style sequence parallel, on the ``tp`` axis, driven by the model plan.

Sequence parallel keeps the residual stream sharded over the sequence between TP regions (attention, MLP, MoE
blocks: see ``models.plan``): each region all-gathers its input and hands back sequence shards; the norms in
between, however many a layer has, run on ``S/tp`` tokens, and any other module there runs replicated on the
gathered sequence (``sequence_parallel``: gathered regions). The
embedding and the model's mask/position computation stay on the full sequence; the first decoder layer takes
its shard (a local slice, no communication) and the last one all-gathers its output, so the final norm and the
head see the full sequence as the model's own code expects (some models reshape there).

One rule covers every parameter that all TP ranks hold whole but apply to different data (this rank's heads,
this rank's sequence shard): it becomes a replicated DTensor whose gradient is summed over TP
(``local_params.run_on_local_params``). The first kind is found by tracing the model's data flow on the meta
device (``models.dataflow``; the plan's ``replicated_with_grad_allreduce`` marks some of them too); under
sequence parallel the second kind is found from the module tree: every norm parameter in a decoder layer outside
its regions.
"""
from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from ...distributed.sequence_padding import pad_sequence
from ...interface.config import ConfigError
from ...interface.hookspecs import hookimpl
from ...interface.loss_part import LossPart
from ...interface.stages import Stage, step
from ...models.placeholder import present_modules
from ...interface.facts import layout_facts
from ...interface.mesh_axes import MeshAxis
from .sequence_parallel import dry_run, gathered_regions, summed_shard_modules
from .shape_check import shape_check
from .regions import model_type, rank_local_params, simple_regions
from .styles import (
    KNOWN_STYLES, checkpoint_view, make_style, param_placement, redistribute_first_input, redistribute_output,
    region_input, replicate_the_rest, run_on_local_params, scale_input_grad,
)


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("tp", int, 1, "tensor-parallel degree (within a node: the innermost mesh axis)", minimum=1,
               ask="Tensor-parallel degree")
    fields.add("sequence_parallel", bool, False, "Megatron-style sequence parallel between the TP regions (auto: "
               "on whenever tp > 1)", auto=lambda config: config.tp > 1,
               ask="Sequence parallel with tensor parallel", ask_when=lambda said: said.get("tp", 1) > 1)
    fields.add("loss_parallel", bool, False, "vocab-parallel cross entropy (the logits stay sharded over tp)")
    # the facts this plugin decides for the others (answered in ultrascale_declare_facts), with their defaults
    fields.fact("sequence_sharded", False, "the activations between blocks are split over the sequence on the tp "
                                           "ranks (sequence parallel)")
    fields.fact("vocab_sharded_loss", False, "the head's logits stay split over the vocabulary into the loss")


@hookimpl
def ultrascale_declare_mesh_axes(config):
    # innermost: consecutive ranks share the fastest links
    return [MeshAxis("tp", config.tp, after="cp", words="+ sequence parallel" if config.sequence_parallel else "",
                     says="sequence_parallel")]


@hookimpl
def ultrascale_declare_facts(config, degrees):
    sharded = degrees.get("tp", 1) > 1
    return {"sequence_sharded": sharded and config.sequence_parallel in (True, "auto"),
            "vocab_sharded_loss": sharded and bool(config.loss_parallel)}


@hookimpl
def ultrascale_validate_config(config, model_config, world_size):
    if config.tp == 1:
        for flag, what in (("sequence_parallel", "to shard the sequence over"),
                           ("loss_parallel", "(the vocabulary is sharded over tp)")):
            if getattr(config, flag):
                raise ConfigError(f"{flag}=True: needs tensor parallel (tp > 1) {what}. Fix: set tp: 2 or more, or "
                                  f"{flag}: false")
        return
    if model_config is None:
        return
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads and heads % config.tp:
        raise ConfigError(f"tp={config.tp}: does not divide num_attention_heads={heads}. Fix: use a tp that divides "
                          f"{heads}")
    if kv_heads and kv_heads % config.tp:
        raise ConfigError(f"tp={config.tp}: does not divide num_key_value_heads={kv_heads} (key/value heads are "
                          f"sharded, not replicated). Fix: use a tp that divides {kv_heads}")
    vocab = getattr(model_config, "vocab_size", None)
    if config.loss_parallel and vocab and vocab % config.tp:
        raise ConfigError(f"loss_parallel=True: needs vocab_size={vocab} divisible by tp={config.tp}. Fix: turn "
                          "loss_parallel off or pad the vocabulary")


@hookimpl
def ultrascale_validate_model(model, plan, config):
    """What only the module tree tells (the model may be on the meta device): a plan exists, its styles are
    known, and under sequence parallel nothing but norms acts on the sequence shards between regions."""
    if config.tp == 1:
        return
    arch = model_type(model)
    if plan is None:
        raise ConfigError(
            f"tp={config.tp}: model type '{arch}' has no tensor-parallel plan. Fix: use tp: 1, or register a "
            "plugin whose ultrascale_declare_model_plan returns one")
    unknown = sorted({s for s in plan.tp_plan.values() if s not in KNOWN_STYLES and s not in plan.styles})
    if unknown:
        raise ConfigError(f"tp={config.tp}: model type '{arch}' uses tensor-parallel style(s) {unknown}, which this "
                          "version cannot apply. Fix: use tp: 1 for this model")
    _build_styles(model, plan, config)  # every style and parameter placement shard_model will apply
    # a packed Linear's weight is sharded by FSDP over its columns (data_parallel.beside_strided_rows); its bias has
    # no other dim, and torch mis-places the gradients of nested strided shards of one dim
    packed = [fqn for fqn, name in plan.matches(model).items() if name == "packed_colwise"
              and getattr(model.get_submodule(fqn), "bias", None) is not None]
    if packed and layout_facts(config).states_sharded:
        raise ConfigError(f"tp={config.tp}: module '{packed[0]}' of model type '{arch}' has the tensor-parallel style "
                          "'packed_colwise' (a strided shard of its rows) and a bias, which this layout's FSDP "
                          "sharding can split by rows only: the optimizer step would come out wrong. Fix: use "
                          "zero_stage: 0, or give that module 'colwise_gather_output'")
    mixed = rank_local_params(model, plan).mixed
    if mixed:
        raise ConfigError(
            f"tp={config.tp}: in model type '{arch}', {sorted(mixed)[:3]} meet both this rank's slice of the "
            "features and replicated data, so neither summing nor keeping their gradients is right. Fix: use tp: 1 "
            "for this model")
    try:
        shape_check(model, plan, config.tp)
    except Exception as exc:  # noqa: BLE001 - the model's code does not accept one rank's shapes
        raise ConfigError(
            f"tp={config.tp}: model type '{arch}' does not run with its tensor-parallel plan's shards (tried with "
            f"one rank's shapes on the meta device: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}). Fix: use tp: 1 for this model") from exc
    if config.sequence_parallel:
        gathered, stuck = gathered_regions(model, plan)
        if stuck:
            raise ConfigError(
                f"sequence_parallel=True: in model type '{arch}', {stuck[:3]} hold parameters outside the "
                "tensor-parallel regions of its plan and no module around them inside the decoder layer can run "
                "on the gathered sequence instead, so they would see only this rank's part of the sequence. Fix: "
                "set sequence_parallel: false for this model")
        try:
            dry_run(model, plan, gathered, config.tp)
        except Exception as exc:  # noqa: BLE001 - any failure means the split sequence does not flow through
            raise ConfigError(
                f"sequence_parallel=True: model type '{arch}' does not run with its sequence split between the "
                f"tensor-parallel regions of its plan (tried on the meta device: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}). Fix: set sequence_parallel: false for "
                "this model") from exc


def _build_styles(model, plan, config) -> None:
    """Make the ParallelStyle of every module the plan matches and the placement of every parameter it names, as
    ``shard_model`` does (construction needs no mesh), so a style this version cannot build is refused
    before launch rather than in every worker."""
    for fqn, name in plan.matches(model).items():
        try:
            make_style(name, sequence_parallel=config.sequence_parallel, loss_parallel=config.loss_parallel,
                       is_head=(fqn == plan.lm_head), extra=plan.styles)
        except ConfigError as exc:
            raise ConfigError(f"tp={config.tp}: model type '{model_type(model)}', module '{fqn}': {exc}") from None
    for fqn, style in plan.param_matches(model).items():
        owner, _, name = fqn.rpartition(".")
        _placement(style, fqn, getattr(model.get_submodule(owner), name).ndim)


def _placement(style: str, fqn: str, ndim: int):
    placement = param_placement(style, ndim)
    if placement is None:
        raise ConfigError(f"tp plan style '{style}' on parameter '{fqn}' is not supported. Fix: use tp: 1 "
                          "for this model")
    return placement


@hookimpl
def ultrascale_transform_stages(config, model_config):
    sp = " + sequence parallel between them" if config.sequence_parallel else ""
    return [Stage("tp", shard_model, after=("float8", "ep"), axes=("tp",), active=config.tp > 1,
                  does=f"attention heads and MLP features split over {config.tp} ranks{sp}, the plan's styles")]


@dataclasses.dataclass
class _TpCut:
    """What ``shard_model`` decided for one model (a pipeline stage's, or the whole): the plan's modules present in
    it and their styles' names (``matched``), the trace's verdict (``flow``), the regions handed back by one
    row-parallel layer (``simple``) or reduced where their sum ends (``summed``), the decoder layers present, and
    whether this model ends the sequence-parallel stretch at the head (``head_end``) or starts it at a
    vocabulary-parallel embedding (``start_end``)."""

    plan: object
    mesh: object
    sp: bool
    present: set
    matched: dict
    flow: object
    simple: set
    summed: set
    layers: list
    head_end: bool
    start_end: bool


def shard_model(model, ctx):
    """Tensor parallel's transform: the plan's styles on its modules, the parameters that meet only this rank's
    slice summed over TP, one reduction per region, sequence parallel's splits and gathers, the tied head, and every
    other parameter replicated over TP."""
    if not ctx.dims.enabled("tp"):
        return
    cut = _cut(model, ctx)
    styles = _module_styles(cut, ctx.config.loss_parallel)
    gathered = gathered_regions(model, cut.plan)[0] if cut.sp else []
    seq_modules = summed_shard_modules(model, cut.plan, gathered) if cut.sp else []
    parallelize_module(model, cut.mesh, styles)
    for fqn, module in seq_modules:
        if fqn in cut.present:
            run_on_local_params(module, cut.mesh, replicate_plain=True)
    _sum_local_params(model, cut)
    _reduce_regions(model, cut)
    if cut.sp:
        _split_sequence(model, cut, gathered)
    if cut.plan.tied and cut.plan.embedding in cut.present and cut.plan.lm_head in cut.present:
        _tie_head(model, cut.plan)
    if not ctx.dims.facts.states_sharded:  # FSDP makes every parameter a DTensor itself
        replicate_the_rest(model, cut.mesh)


def _cut(model, ctx) -> _TpCut:
    """The plan's named parameters sharded, then the trace of the model's data flow and what follows from it."""
    plan, sp = ctx.plan, ctx.config.sequence_parallel
    mesh = ctx.sub_mesh("tp")
    present = present_modules(model)
    matched = {fqn: name for fqn, name in plan.matches(model).items() if fqn in present}
    simple = simple_regions(plan, matched)
    _shard_named_params(model, plan, mesh, present)
    _mark_mla_rope_width(model, matched)
    flow = rank_local_params(model, plan)
    model._ultrascale_tp_flow = flow  # what the estimate of this model's collectives counts (dims.tensor.costs)
    layers = ctx.plan_layers(model)
    # under SP, the stage that ends the model reduce-scatters the head's input gradient at the last layer's gather
    head_end = (sp and flow.end is not None and plan.lm_head in present and bool(layers)
                and layers[-1] == plan.layers[-1])
    # ... and the stage that starts it reduce-scatters a vocabulary-parallel embedding's partial sum
    start_end = sp and flow.start and plan.embedding in present and bool(layers) and layers[0] == plan.layers[0]
    summed = flow.sums - simple  # regions of several addends, reduced once where they end (Megatron's "g")
    return _TpCut(plan, mesh, sp, present, matched, flow, simple, summed, layers, head_end, start_end)


def _mark_mla_rope_width(model, matched: dict) -> None:
    """The ``mla_kv_a_proj`` style sums the rotary part of the projection's output over TP: it reads that part's
    width from the module, which knows nothing of the model's config."""
    for fqn, name in matched.items():
        if name == "mla_kv_a_proj":
            model.get_submodule(fqn).qk_rope_head_dim = model.config.qk_rope_head_dim


def _module_styles(cut: _TpCut, loss_parallel: bool) -> dict:
    """{module: its ``ParallelStyle``}: the plan's style, handing back sequence shards where its region is simple,
    leaving its input's gradient partial where its region reduces it once, and its output partial where its region
    is reduced where its sum ends."""
    plan, flow = cut.plan, cut.flow
    region_of = {f: next((r for r in plan.regions if f.startswith(r + ".")), None) for f in cut.matched}
    once = {fqn for consumers in flow.block.values() for fqn in consumers}  # their region reduces their input
    if cut.head_end:
        once.add(plan.lm_head)
    return {fqn: make_style(name, sequence_parallel=cut.sp, loss_parallel=loss_parallel,
                            is_head=(fqn == plan.lm_head), extra=plan.styles,
                            shard_output=region_of.get(fqn) in cut.simple, partial_input=fqn in once,
                            partial_output=(region_of.get(fqn) in cut.summed
                                            or (cut.start_end and fqn == plan.embedding)))
            for fqn, name in cut.matched.items()}


def _sum_local_params(model, cut: _TpCut) -> None:
    """The plain parameters that meet only this rank's slice become replicated DTensors whose gradients are summed
    over TP: the trace's, those applied to a region's partial sum, and the final norm where the head ends SP."""
    flow = cut.flow
    owners: dict[str, set[str]] = {}
    for name in flow.local:
        owner, _, pname = name.rpartition(".")
        owners.setdefault(owner, set()).add(pname)
    for region in cut.summed:  # e.g. LoRA's B after a row-parallel A: applied to a partial sum
        gate_params = [f"{g}.{n}" for g in flow.gates.get(region, ()) if g in cut.present
                       for n, _ in model.get_submodule(g).named_parameters()]  # a gate of the sum
        for name in [*flow.summed_params.get(region, ()), *gate_params]:
            owner, _, pname = name.rpartition(".")
            owners.setdefault(owner, set()).add(pname)
    for name in flow.end if cut.head_end else ():  # the final norm: it sees the head's partial gradient
        owner, _, pname = name.rpartition(".")
        owners.setdefault(owner, set()).add(pname)
    for owner, names in owners.items():
        if owner in cut.present:
            run_on_local_params(model.get_submodule(owner), cut.mesh, replicate_plain=True, only=names)


def _reduce_regions(model, cut: _TpCut) -> None:
    """Megatron's "f" (one reduction of a region's input gradient) where the trace found one, and its "g" (the
    reduction of a region's partial sum) where the sum ends."""
    flow, mesh, sp, present = cut.flow, cut.mesh, cut.sp, cut.present
    for region in flow.block:  # one reduction of the input's gradient per region, Megatron's "f"
        if region in present:
            model.get_submodule(region).register_forward_pre_hook(region_input(mesh, sp), with_kwargs=True)
            # readers whose input gradient is whole: 1/tp of it (a gate of a sum reduced once has a partial one)
            gates = flow.gates.get(region, set()) if region in cut.summed else set()
            for fqn in flow.scaled.get(region, set()) - gates:
                model.get_submodule(fqn).register_forward_pre_hook(scale_input_grad(1 / mesh.size()),
                                                                   with_kwargs=True, prepend=True)
    for region in cut.summed:
        if region in present and region in flow.sum_end:  # a norm on the sum ends the region: reduced at its input
            norm = model.get_submodule(flow.sum_end[region])
            norm.register_forward_pre_hook(redistribute_first_input(mesh, Partial(), Shard(1) if sp else Replicate()),
                                           with_kwargs=True)
            if sp:  # it runs on this rank's sequence shard, as the norms between regions do
                run_on_local_params(norm, mesh, replicate_plain=True)
        elif region in present:
            model.get_submodule(region).register_forward_hook(
                redistribute_output(mesh, Partial(), Shard(1) if sp else Replicate()))


def _split_sequence(model, cut: _TpCut, gathered) -> None:
    """Sequence parallel: each region gathers its input and hands back sequence shards, the ``gathered`` regions
    run replicated on the whole sequence, and the (stage's) layers split the sequence where they start and gather
    it where they end."""
    mesh, present = cut.mesh, cut.present
    for region in cut.plan.regions:
        if region in present:
            module = model.get_submodule(region)
            if region not in cut.flow.block:  # each projection reduces its input's gradient (a slice here)
                module.register_forward_pre_hook(redistribute_first_input(mesh, Shard(1), Replicate()),
                                                  with_kwargs=True)
            if region not in cut.simple and region not in cut.summed:
                module.register_forward_hook(redistribute_output(mesh, Replicate(), Shard(1)))
    for region in gathered:  # see sequence_parallel: runs replicated on the whole sequence
        if region in present:
            module = model.get_submodule(region)
            module.register_forward_pre_hook(redistribute_first_input(mesh, Shard(1), Replicate()),
                                              with_kwargs=True)
            module.register_forward_hook(redistribute_output(mesh, Replicate(), Shard(1)))
    if cut.layers:
        # the sequence is split where the (stage's) layers start and gathered again where they end: the
        # model builds its masks and positions, and reshapes the final hidden states, on the full sequence
        model.get_submodule(cut.layers[0]).register_forward_pre_hook(
            redistribute_first_input(mesh, Partial() if cut.start_end else Replicate(), Shard(1)), with_kwargs=True)
        model.get_submodule(cut.layers[-1]).register_forward_hook(
            redistribute_output(mesh, Shard(1), Replicate(), Partial() if cut.head_end else None))


def _tie_head(model, plan) -> None:
    """parallelize_module gives each module a fresh Parameter; tie the head back to the embedding's."""
    embed, head = model.get_submodule(plan.embedding), model.get_submodule(plan.lm_head)
    if head.weight is not embed.weight:
        if getattr(embed.weight, "placements", None) != getattr(head.weight, "placements", None):
            raise ConfigError(f"tied embedding '{plan.embedding}' and head '{plan.lm_head}' got different TP "
                              "placements. Fix: shard both by vocabulary rows, or neither, in the plan")
        head.weight = embed.weight


def _shard_named_params(model, plan, mesh, present) -> None:
    """Parameters the plan names directly (fused expert weights, attention sinks) become DTensors placed as
    transformers places them; their module's style runs on the local shards."""
    for fqn, style in plan.param_matches(model).items():
        owner, _, name = fqn.rpartition(".")
        if owner not in present:
            continue
        module = model.get_submodule(owner)
        param = getattr(module, name)
        if isinstance(param, DTensor):
            continue
        placement = _placement(style, fqn, param.ndim)
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                     requires_grad=param.requires_grad))


@hookimpl
def ultrascale_state_checkpoint_view(tensor):
    view = checkpoint_view(tensor)
    return None if view is tensor else view


@hookimpl
@step("tp")
def ultrascale_cost_estimate(config, model_config, shape, estimate):
    from .costs import tensor_parallel_terms

    tensor_parallel_terms(config, shape, estimate)


@hookimpl
def ultrascale_cost_comm_minimum(config, shape):
    """The least communication tensor parallel's ``tp`` axis needs for a step (``minimum``)."""
    from .minimum import tensor_minimum

    return tensor_minimum(config, shape)


def tp_degree(devices_per_node: int, model_config) -> int:
    """The largest divisor of the devices per node that divides the attention and key/value head counts."""
    from ...interface.presets import largest_divisor

    heads = getattr(model_config, "num_attention_heads", None) or 1
    kv = getattr(model_config, "num_key_value_heads", None) or heads
    return largest_divisor(devices_per_node, devices_per_node, lambda d: heads % d == 0 and kv % d == 0)


def _tp_layout(sequence_parallel: bool):
    def layout(world, per_node, model_config):
        tp = tp_degree(per_node, model_config)
        return {"tp": tp, "dp_shard": world // tp, "sequence_parallel": sequence_parallel and tp > 1}
    return layout


@hookimpl
@step("tp")
def ultrascale_step_shard_batch(batch, ctx):
    """Sequence parallel splits each row's tokens evenly over tp (and, with context parallel, each cp rank's
    head-tail chunks): a length that does not divide is padded on the right first (``pad_sequence``: hidden from
    the real tokens by causality, its targets ignored). At "tp": before context parallel takes its part."""
    facts = layout_facts(ctx.config)
    tp, cp = facts.degree("tp"), facts.degree("cp")
    if tp > 1 and facts.sequence_sharded:
        pad_sequence(batch, tp * (2 * cp if cp > 1 else 1))


@hookimpl
def ultrascale_step_loss(pmodel):
    """The vocabulary-parallel cross-entropy (``loss_parallel``) where the layout asks for it."""
    if pmodel.config.loss_parallel and pmodel.dims.enabled("tp"):
        return VocabParallelLoss()
    return None


class VocabParallelLoss(LossPart):
    """The loss and its backward run inside torch's ``loss_parallel``: the head's logits stay sharded over TP."""

    def context(self):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


@hookimpl
def ultrascale_declare_presets():
    from ...interface.presets import Preset

    return [Preset("tp", "tensor parallel within a node, ZeRO-3 across", _tp_layout(False)),
            Preset("tp_sp", "tensor + sequence parallel within a node, ZeRO-3 across", _tp_layout(True))]


@hookimpl
def ultrascale_declare_accelerate_keys():
    return {"tp_size": ("tp", {})}

"""Expert parallelism: each rank holds 1/ep of every mixture-of-experts layer's experts, and tokens travel to them.

Built only on the public hooks, as a third-party dimension would be:

- the field ``ep`` (``ultrascale_declare_fields``) and a mesh view ``experts`` (``ultrascale_declare_mesh_axes``): the ranks of
  dp_shard x cp x tp counted again as efsdp x ep (torchtitan's "dp2ep": ep borrows its ranks from data, context
  and tensor parallelism, so it adds nothing to the world size); ``efsdp`` = dp_shard*cp*tp / ep is the experts'
  own data-parallel degree;
- the plan (``ultrascale_declare_plan_edit``): the experts modules that transformers' expert-parallel plan names
  (``base_model_ep_plan``'s ``ep_dispatch_experts`` entries, which the modeling files put on every experts module
  that goes through ``use_experts_implementation``) are taken out of the tensor-parallel plan (experts are not
  also split by TP: fine-grained experts are too thin, and every TP rank would repeat the exchange, as torchtitan
  found) and put in the view, so data parallelism shards them over efsdp in groups of their own and reduces
  their gradients there;
- checks before any process group (``ultrascale_validate_config`` / ``ultrascale_validate_model``);
- the transform (stage ``ep``, before tensor parallel): every expert parameter becomes a DTensor sharded by expert over the
  ``ep`` axis (so checkpoints hold whole experts and load in any ep), the module keeps its local expert count,
  and its forward becomes the token exchange of ``ep_dispatch``, around the module's own forward.

Routing is untouched: the router runs as the model wrote it, on every token (dropless token choice).
"""
from __future__ import annotations

import fnmatch
import math

from torch import nn

from ...interface.config import ConfigError, field_error
from ...interface.facts import layout_facts
from ...interface.hookspecs import hookimpl
from ...interface.stages import Stage, step
from ...interface.mesh_axes import MeshAxis, MeshView
from ...interface.plan_edit import PlanEdit
from ...interface.moe_config import experts_per_token, routed_experts, text_config

VIEW = "experts"
STYLE = "ep_experts"  # the experts modules' entry in the tensor-parallel plan
SOURCE = ("dp_shard", "cp", "tp")  # the layout axes whose ranks ep borrows
LAYOUT_FLAGS = ("has_gate", "is_transposed", "is_concatenated", "has_bias", "has_post_expert_norm")


@hookimpl
def ultrascale_declare_fields(fields):
    fields.add("ep", int, 1, "expert-parallel degree: each rank holds 1/ep of every MoE layer's experts; the ep ranks "
               "are borrowed from dp_shard*cp*tp (which ep must divide), and the experts are sharded by ZeRO over the "
               "rest, efsdp = dp_shard*cp*tp/ep", minimum=1,
               ask="Expert-parallel degree, for a mixture of experts")


@hookimpl
def ultrascale_declare_mesh_axes(config):
    if config.ep == 1:
        return []
    return [MeshView(VIEW, SOURCE, (MeshAxis("efsdp", -1, reduces_grads=True), MeshAxis("ep", config.ep)))]


def _borrowed(config) -> tuple[list[int], int]:
    """The degrees of the axes ep borrows its ranks from, and their product (-1 for the one not resolved yet)."""
    facts = layout_facts(config)
    degrees = [facts.degree(axis) for axis in SOURCE]
    return degrees, math.prod(max(d, 1) for d in degrees)


@hookimpl(tryfirst=True)
def ultrascale_validate_config(config, model_config, world_size):
    if config.ep == 1:
        return
    degrees, borrowed = _borrowed(config)
    if -1 not in degrees and borrowed % config.ep:
        raise field_error("ep", config.ep, f"expert parallelism borrows its ranks from {'*'.join(SOURCE)} = "
                          f"{'*'.join(map(str, degrees))} = {borrowed}, which {config.ep} does not divide",
                          f"pick an ep that divides {borrowed}")
    if model_config is not None:
        count = routed_experts(model_config)
        if count is None:
            raise field_error("ep", config.ep, f"model type '{getattr(model_config, 'model_type', '?')}' has no "
                              "routed experts", "use ep: 1")
        if count % config.ep:
            raise field_error("ep", config.ep, f"the model's {count} experts per layer do not split evenly over "
                              f"{config.ep} ranks", f"pick an ep that divides {count}")


def _ep_plan(model: nn.Module, plan) -> dict[str, str]:
    """transformers' expert-parallel plan of the causal LM in ``model``, as full-FQN patterns from ``model``'s
    root."""
    lm = plan.causal_lm(model) if plan is not None else model
    root = plan.root if plan is not None and plan.root else ""
    prefix = getattr(lm, "base_model_prefix", "") or ""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    ep_plan = getattr(config, "base_model_ep_plan", None) or getattr(lm.config, "base_model_ep_plan", None) or {}
    return {".".join(p for p in (root, prefix, key) if p): style for key, style in ep_plan.items()}


def experts_modules(model: nn.Module, plan) -> list[str]:
    """The experts modules of ``model`` that transformers' expert-parallel plan names (``ep_dispatch_experts``)."""
    patterns = [p for p, style in _ep_plan(model, plan).items() if style == "ep_dispatch_experts"]
    return [fqn for fqn, _ in model.named_modules() if any(fnmatch.fnmatchcase(fqn, p) for p in patterns)]


def expert_parameters(model: nn.Module, plan) -> set[str]:
    """The parameters the plan splits by expert (``grouped_gemm``: the fused weights, their biases, a per-expert
    norm's scales), as parameter FQNs of ``model``."""
    patterns = [p for p, style in _ep_plan(model, plan).items() if style == "grouped_gemm"]
    return {fqn for fqn, _ in model.named_parameters(remove_duplicate=False)
            if any(fnmatch.fnmatchcase(fqn, p) for p in patterns)}


@hookimpl
def ultrascale_declare_plan_edit(model, plan, config):
    if config.ep == 1:
        return None
    found = experts_modules(model, plan)
    if not found:
        return None  # ultrascale_validate_model refuses it, with the reason
    inside = set(plan.matches(model)) | set(plan.param_matches(model))
    entries = {fqn: None for fqn in inside if any(fqn.startswith(e + ".") for e in found)}
    entries.update({fqn: STYLE for fqn in found})
    return PlanEdit(entries=entries, styles={STYLE: _whole_on_every_tp_rank}, views={fqn: VIEW for fqn in found})


def _whole_on_every_tp_rank(sequence_parallel=False, loss_parallel=False):
    """The experts' style in a tensor-parallel layout: nothing to shard (each TP rank holds whole experts, by
    expert parallelism), and the block around them a TP region (``opens_region``): their input is the MoE
    block's whole hidden states on every TP rank (gathered under sequence parallel), and their output is whole
    on every TP rank (``ep_dispatch`` splits the tokens among the TP ranks and gathers the outputs back)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class ExpertsOnEveryTPRank(ParallelStyle):
        def _apply(self, module, device_mesh):
            return module

    return ExpertsOnEveryTPRank()


_whole_on_every_tp_rank.opens_region = True


@hookimpl
def ultrascale_validate_model(model, plan, config):
    if config.ep == 1:
        return
    import transformers

    found = experts_modules(model, plan)
    arch = getattr(model.config, "model_type", type(model).__name__)
    if not found and any(style == "ep_dispatch_experts" for style in _ep_plan(model, plan).values()):
        raise field_error("ep", config.ep, f"this model of type '{arch}' has no experts modules where transformers' "
                          "expert-parallel plan expects them (its config turns the mixture of experts off, e.g. "
                          "enable_moe_block=False)", "use ep: 1, or a config with its experts on")
    if not found:
        raise field_error("ep", config.ep, f"transformers {transformers.__version__} names no experts of model type "
                          f"'{arch}' for expert parallelism (its base_model_ep_plan has no 'ep_dispatch_experts' "
                          "entry; transformers 5.25 has them for every MoE model built on its experts interface)",
                          "use ep: 1, or a transformers release whose modeling file has an expert-parallel plan")
    for fqn in found:
        module = model.get_submodule(fqn)
        # the experts module and its parts (a per-expert norm) are the modeling file's (transformers', or a remote
        # model's transformers_modules) or torch's; another library's module was put around them (adapters: PEFT's
        # target_parameters, which all-linear adds on MoE models)
        added = [(n or "the module itself", type(m).__module__.split(".")[0]) for n, m in module.named_modules()
                 if not type(m).__module__.startswith(("transformers", "torch."))]
        if added:
            raise field_error("ep", config.ep, f"'{fqn}' carries modules from {added[0][1]} ({added[0][0]}: adapters, "
                              "e.g. PEFT's target_parameters, which all-linear adds on MoE models), which expert "
                              "parallelism does not split with the experts", "keep adapters off the experts "
                              "(target_modules without the experts' parameters), or use ep: 1")
        missing = [a for a in (*LAYOUT_FLAGS, "num_experts") if not hasattr(module, a)]
        if missing:
            raise field_error("ep", config.ep, f"'{fqn}' ({type(module).__name__}) does not go through transformers' "
                              f"experts interface (no {', '.join(missing)}), so its forward cannot be handed this "
                              "rank's experts", "use ep: 1")
        if module.num_experts % config.ep:
            raise field_error("ep", config.ep, f"'{fqn}' has {module.num_experts} experts, which do not split evenly "
                              f"over {config.ep} ranks", f"pick an ep that divides {module.num_experts}")
        split = expert_parameters(model, plan)
        for name, param in module.named_parameters():
            if f"{fqn}.{name}" not in split:
                raise field_error("ep", config.ep, f"'{fqn}.{name}' is a parameter of the experts that transformers' "
                                  "expert-parallel plan does not split by expert, so every rank would apply it to "
                                  "other experts' tokens", "use ep: 1")
            if param.shape[0] != module.num_experts:
                raise field_error("ep", config.ep, f"'{fqn}.{name}' has {param.shape[0]} rows, not one per expert "
                                  f"({module.num_experts})", "use ep: 1")


@hookimpl
def ultrascale_transform_stages(config, model_config):
    return [Stage("ep", shard_experts, after=("float8",), before=("tp",), axes=("ep",), active=config.ep > 1,
                  does=f"the experts split over {config.ep} ranks, tokens dispatched to them and back (all-to-all)")]


def shard_experts(model, ctx):
    if ctx.config.ep == 1:
        return
    from torch.distributed.tensor import DTensor, Shard

    from .dispatch import ExpertDispatch

    dims = ctx.dims
    ep_mesh = dims.sub_mesh("ep", view=VIEW)
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    # the ranks of the borrowed axes that hold the same tokens (tensor parallel outside its regions): each
    # sends a disjoint slice of them
    same = tuple(a.name for a in dims.live_axes if a.name in SOURCE and not a.counts_tokens)
    shared = dims.group(same) if same else None
    for fqn, view in ctx.view_modules(model).items():
        if view != VIEW:
            continue
        module = model.get_submodule(fqn)
        for owner in module.modules():  # the experts' own weights and a per-expert norm's scales alike
            for name, param in list(owner.named_parameters(recurse=False)):
                local = param.detach().chunk(ep)[rank].clone()
                owner.register_parameter(name, nn.Parameter(
                    DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False),
                    requires_grad=param.requires_grad))
        local_experts = module.num_experts // ep
        own_forward = module.forward
        module.num_experts = local_experts  # what the experts' own forward counts (grouped_mm's bins)
        module.forward = ExpertDispatch(module, own_forward, local_experts, ep_mesh.get_group(), shared)


@hookimpl
@step("ep")
def ultrascale_cost_estimate(config, model_config, shape, estimate):
    """Each rank holds 1/ep of the experts: the expert view's records cut on dim 0 (experts), before data
    parallelism shards them over efsdp. And the tokens travel (``ep_dispatch``): per MoE layer and micro-batch,
    the forward's dispatch and combine all-to-alls and their gradients' in the backward (and the forward's again
    when the layer is recomputed), each moving this rank's tokens x top_k rows of the hidden size, of which
    (ep-1)/ep leave the rank. The ranks that hold the same tokens (tensor parallel) each send a slice of them."""
    if config.ep == 1:
        return
    import math

    from ...interface.estimates import chunk_size
    from ...interface.parallel_dims import ParallelDims

    index = shape.coords.get("ep", 0)
    moe_layers = set()
    for r in shape.inventory:
        if r.view == VIEW and r.local:
            r.local = (chunk_size(r.local[0], config.ep, index), *r.local[1:])
            moe_layers.add(r.layer)
    if not moe_layers:  # a pipeline rank without MoE layers exchanges nothing
        return
    text = text_config(model_config)
    top_k = experts_per_token(text)
    dims = ParallelDims(config)
    same = [a.degree for a in dims.live_axes if a.name in SOURCE and not a.counts_tokens]
    sharing = 1
    for degree in same:
        sharing *= degree
    tokens = -(-shape.tokens_per_micro_batch // sharing)  # this rank's slice (the most loaded one)
    # the bytes handed to each all-to-all (the planner's time counts the (ep - 1) / ep of them that leave the rank)
    volume = tokens * top_k * text.hidden_size * shape.activation_bytes(config)
    recompute = layout_facts(config).recompute != "none"  # selective re-runs the exchange too (not saved)
    passes = 4 + (2 if recompute else 0)  # dispatch + combine: forward, backward, recomputed forward
    calls = 5 + (3 if recompute else 0)  # and each forward's exchange of the split sizes
    n = len(moe_layers)
    estimate.add_comm("ep", passes * volume * n, "all_to_all", calls=calls * n, per="micro_batch")
    # each local expert's matmul gets the rows the ep ranks route to it: ep x this rank's share of them
    count = routed_experts(model_config) or config.ep
    width = max((math.prod(r.shape[1:]) for r in shape.inventory if r.view == VIEW and len(r.shape) == 3), default=0)
    if width:
        estimate.factors["expert_matmul_gflop"] = 2 * config.ep * tokens * top_k / count * width / 1e9


@hookimpl
def ultrascale_cost_comm_minimum(config, shape):
    """The least communication expert parallel's ``ep`` axis needs for a step (``minimum``)."""
    from .minimum import expert_minimum

    return expert_minimum(config, shape)


@hookimpl
def ultrascale_declare_presets():
    from ...interface.presets import Preset

    def layout(world, per_node, model_config):
        count = routed_experts(model_config) if model_config is not None else None
        ep = max(d for d in range(1, max(1, per_node) + 1)
                 if world % d == 0 and (count is None or count % d == 0))
        return {"dp_shard": world, "ep": ep, "zero_stage": 3}

    return [Preset("ep", "expert parallel within a node (ep = the largest number of devices per node that divides "
                   "the experts and the world), ZeRO-3 over every device", layout)]


@hookimpl
def ultrascale_declare_accelerate_keys():
    return {"ep_size": ("ep", {})}


@hookimpl
def ultrascale_cost_search(config, model_config, world_size):
    """The planner's expert-parallel degrees for a candidate layout (its choices): each ep (1 included) that divides
    both the experts per MoE layer and the ranks ep borrows (dp_shard*cp*tp). Only under ZeRO-2/3: the experts get
    FSDP2 groups of their own over efsdp, which data parallelism refuses under ZeRO-0/1 (a check on the model, which
    the search does not run)."""
    from ...interface.search_offer import SearchOffer

    count = routed_experts(model_config) if model_config is not None else None
    if count is None or not layout_facts(config).fsdp_units:
        return None
    borrowed = _borrowed(config)[1]
    return SearchOffer(choices={"ep": [d for d in range(1, borrowed + 1) if borrowed % d == 0 and count % d == 0]})

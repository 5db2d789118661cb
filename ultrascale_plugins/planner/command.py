"""``ultrascale plan``: the planner's command line."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from ..interface.config import ConfigError
from ..interface.estimates import OPTIMIZERS, PROFILES
from ..interface.fake_values import ROUTINGS
from .hardware import PRESETS as GPU_PRESETS
from .headroom import MEMORY_MARGIN
from .model_spec import PRESETS as MODEL_PRESETS


# config.json keys the printed recipe's model: section leaves out: the writer's library and dtype, the class names
# (the model type says them); auto_map names remote code this package never runs (transformers has the model
# type); quantization_config says how the published weights are stored (DeepSeek-V3's fp8 blocks), not what a
# training run holds: the plan costs fp32 weights computing in bf16
NOT_IN_RECIPE = frozenset({"transformers_version", "architectures", "torch_dtype", "dtype", "auto_map",
                           "quantization_config"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a Hugging Face config.json (or its directory), or one of: "
                   + ", ".join(MODEL_PRESETS))
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: 8, or the profile's --gpu FILE)")
    p.add_argument("--gpu", help="hardware preset: " + ", ".join(GPU_PRESETS) + "; or a profile FILE written by "
                   "ultrascale calibrate (or the four figures below)")
    p.add_argument("--gpu-memory-gb", type=float)
    p.add_argument("--gpu-tflops", type=float, help="dense bf16 peak per GPU")
    p.add_argument("--intra-node-gbps", type=float, help="per-GPU bandwidth inside a node, GB/s")
    p.add_argument("--inter-node-gbps", type=float, help="per-GPU bandwidth between nodes, GB/s")
    p.add_argument("--host-link-gbps", type=float, help="per-GPU bandwidth to host memory, GB/s (the preset's "
                   "PCIe, else 32): what offloaded states cross")
    p.add_argument("--host-memory-gb", type=float, help="host memory per GPU for offloaded states (default 256: "
                   "a DGX H100's 2 TB over 8 GPUs)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch-size", type=int, default=256, help="sequences per optimizer step")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--profile", default="ultrascale", choices=PROFILES,
                   help="memory of this package's implementation, of nanotron as the Ultra-Scale Playbook ran it, or "
                   "of Megatron-DeepSpeed with its ZeRO-1 as the Frontier study ran it")
    p.add_argument("--peft", choices=("lora", "qlora"), help="train PEFT adapters on a frozen base: only they get "
                   "gradients and optimizer states, and the base computes no weight gradients; qlora: the adapted "
                   "base weights in 4-bit NF4 (torchao), under data parallel only")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (with --peft lora)")
    p.add_argument("--lora-target", default="all-linear", help="'all-linear' (as PEFT resolves it: with transformers "
                   "5 a mixture of experts' fused expert weights and router too) or module names, e.g. q_proj,v_proj")
    p.add_argument("--lora-alpha", type=float, help="accepted for a LoraConfig's sake: it scales the update and "
                   "changes neither memory nor time")
    p.add_argument("--layout", help='cost exactly one layout, e.g. "dp=8,tp=1,pp=1,cp=1,zero=1,mbs=2,ga=16,'
                   'recompute=none" (also schedule=, virtual=, dp_replicate=, sp=)')
    p.add_argument("--memory-margin", type=float, default=MEMORY_MARGIN, help="rank first every layout whose "
                   "predicted memory leaves this share of the GPU's free (default: the memory estimate's "
                   f"90th-percentile error against measured runs, {MEMORY_MARGIN}); 0: by speed alone")
    # removed: the first choice leaves the margin whenever any layout does, so no speed is traded against it
    p.add_argument("--speed-tolerance", type=float, help=argparse.SUPPRESS)
    p.add_argument("--top", type=int, default=10, help="rows to show")
    p.add_argument("--all", action="store_true", help="rank layouts this engine cannot run too")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--explain", action="store_true", help="also print the chosen layout as us.describe says it: the mesh "
                   "and its views, the model transforms in order, the step hooks' plugins and the cost chain, each "
                   "with its after/before")
    p.add_argument("--plot", help="write a PNG: memory of the top layouts and the chosen pipeline schedule")
    p.add_argument("--dry-run", action="store_true", help="with --layout: run one step of the real code path for "
                   "that layout at full size on fake tensors (us.dry_run) and print its peak memory by category and "
                   "bytes per mesh axis beside the estimate; without: the plan, and a dry run of each of its first "
                   "--dry-run-top candidates beside the planner's figure")
    p.add_argument("--dry-run-top", type=int, default=3, metavar="K",
                   help="with --dry-run and no --layout: how many of the first runnable candidates to dry-run")
    p.add_argument("--routing", choices=tuple(ROUTINGS), default="uniform",
                   help="with --dry-run: the routing of tokens to experts the step assumes (uniform: each "
                   "rank's tokens split evenly over the ep ranks; all-to-one: all to the traced rank)")


def build(args):
    """(cost model, model fields for a recipe) from the arguments; every input checked before any work."""
    from .cost import CostModel, Workload
    from .hardware import hardware_from_args
    from .model_spec import ModelSpec, load_model_config

    for name in ("gpus", "seq_len", "global_batch_size", "top"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1. Fix: give a "
                              "positive number")
    if getattr(args, "speed_tolerance", None) is not None:
        raise ConfigError(f"--speed-tolerance {args.speed_tolerance}: no longer an option: the first choice leaves "
                          "the memory margin whenever any layout does, and the plan shows the fastest layout at the "
                          "edge beside it. Fix: drop it (--memory-margin 0 ranks by speed alone)")
    if not 0 <= args.memory_margin < 1:
        raise ConfigError(f"--memory-margin {args.memory_margin}: must be a fraction, at least 0 and below 1. "
                          "Fix: e.g. 0.1 for 10 %")
    mc = load_model_config(args.model)  # an unknown model is named first, whatever else is missing
    hw = hardware_from_args(args.gpu, memory_gb=args.gpu_memory_gb, tflops=args.gpu_tflops,
                            intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                            gpus_per_node=args.gpus_per_node)
    if args.gpus > hw.gpus_per_node and args.gpus % hw.gpus_per_node:
        raise ConfigError(f"--gpus {args.gpus} is not a whole number of nodes of {hw.gpus_per_node}. Fix: use a "
                          "multiple of --gpus-per-node")
    for flag, key in (("--host-link-gbps", "host_link_gbps"), ("--host-memory-gb", "host_memory_gb")):
        value = getattr(args, key)
        if value is not None:
            if value <= 0:
                raise ConfigError(f"{flag} {value}: must be positive. Fix: e.g. {flag} 64")
            hw = dataclasses.replace(hw, **{key: value})
    spec = ModelSpec.of(mc, name=str(args.model))
    adapters = None
    if getattr(args, "peft", None):
        from ..interface.estimates import Adapters

        adapters = Adapters(r=args.lora_r, target=args.lora_target, method="lora",
                            quantized="nf4" if args.peft == "qlora" else "")
        spec.trainable_params(adapters)  # targets that match nothing are named now, before any search
    elif getattr(args, "lora_r", 16) != 16 or getattr(args, "lora_target", "all-linear") != "all-linear" \
            or getattr(args, "lora_alpha", None) is not None:
        raise ConfigError("--lora-r / --lora-target / --lora-alpha without --peft lora. Fix: add --peft lora")
    work = Workload(args.seq_len, args.global_batch_size, args.profile, args.optimizer,
                    "bf16" if args.precision == "bf16" else "no", adapters)
    from ..data.model_section import code_reads, config_keys

    known = config_keys(type(mc))[0] | code_reads(type(mc))  # not a config.json's keys transformers does not use
    fields = {k: v for k, v in mc.to_diff_dict().items() if not k.startswith("_") and k in known
              and k not in NOT_IN_RECIPE}
    fields["model_type"] = mc.model_type
    return CostModel(spec, hw, work), fields


def run_plan(args, accelerate_yaml) -> int:
    """``accelerate_yaml``: ``integrations.layout.accelerate_yaml`` (the CLI hands it in)."""
    from . import render
    from .cost import layout_from_string
    from .search import search

    cost, fields = build(args)
    hw = cost.hw
    adapters = cost.work.adapters
    trainable = cost.spec.trainable_params(adapters)
    if getattr(args, "dry_run", False) and (args.layout or args.dry_run_top < 1):
        return _dry_run(args, cost)
    if args.layout:
        lay = layout_from_string(args.layout, args.gpus, cost.pm).replace(mixed_precision=cost.work.precision)
        results = [cost.evaluate(lay)]
    else:
        results = search(cost, args.gpus, include_unrunnable=args.all, margin=args.memory_margin)
    if not results:
        raise ConfigError(f"no layout of {args.gpus} GPUs is possible for this model and batch. Fix: check that the "
                          "global batch divides over the GPUs")
    best = results[0]
    elsewhere = _room_elsewhere(args, cost, results)
    checked = _dry_run_candidates(args, cost, results) if getattr(args, "dry_run", False) else None
    if args.plot:
        from .plot import plot_plan

        plot_plan(results, best, args.plot, hw.memory_gb, top=min(args.top, 8))
    if args.json:
        extra = {**_header(args, cost), "fits": best.fits}
        if elsewhere is not None:
            extra["room_elsewhere"] = render.room_elsewhere_json(elsewhere, cost.savers)
        if checked is not None:
            extra["dry_run_candidates"] = checked
        print(render.as_json(results, args.top, extra, hw.memory_gb, args.memory_margin))
        return 0 if best.fits else 1
    print(f"ultrascale plan: {args.model} ({cost.spec.total_params / 1e9:.2f}B parameters"
          + (f", {cost.spec.active_params / 1e9:.2f}B active" if cost.spec.active_params != cost.spec.total_params
             else "") + f") on {args.gpus} x {hw.describe()}")
    print(f"sequence {args.seq_len}, global batch {args.global_batch_size} sequences, {args.optimizer}, "
          f"{args.precision}, memory profile '{args.profile}'" + ("" if adapters is not None else "\n"))
    if adapters is not None:
        print(f"PEFT: {adapters.describe()}: {trainable / 1e6:,.1f}M trainable parameters "
              f"({trainable / cost.spec.total_params:.2%}); the frozen base is held (and sharded) without gradients "
              "or optimizer states; MFU counts the FLOPs LoRA needs (4 per frozen weight, 6 per trained one)\n")
    print(render.table(results, hw.memory_gb, args.top, args.memory_margin))
    print()
    if checked is not None:
        from .dry_run_candidates import table as dry_run_table

        print(dry_run_table(checked) + "\n")
    if not best.fits:
        host = (f" and {best.memory_gb['host']:.1f} of {hw.host_memory_gb:g} GB of host memory"
                if "host" in best.memory_gb else "")
        print(f"ultrascale plan: no layout of {args.gpus} GPUs fits {hw.memory_gb:g} GB per GPU (the closest needs "
              f"{best.memory_gb['total']:.1f} GB{host}, listed first). Fix: more GPUs, a shorter --seq-len, a smaller "
              "--global-batch-size, or a GPU with more memory", file=sys.stderr)
        return 1
    if not best.runnable:
        print(f"The best layout is not runnable by this engine: {best.not_runnable_because}")
    room = render.headroom_line(best, results, hw.memory_gb, args.memory_margin, elsewhere,
                                frozenset(cost.savers))
    savers = render.saver_costs(best, cost)
    print(f"Chosen: {best.layout.label()}\n  {room}\n  {render.breakdown(best)}\n" + (f"  {savers}\n" if savers else ""))
    if args.explain:
        print(_explain(best, cost, args.gpus) + "\n")
    if adapters is not None:
        print(render.peft_note(adapters, getattr(args, "lora_alpha", None)) + "\n")
    print("Lightning:\n" + _indent(render.lightning_call(best, args.gpus, hw.gpus_per_node)) + "\n")
    print("Accelerate config (ultrascale accelerate-launch FILE train.py):\n"
          + _indent(render.accelerate_config(best, args.gpus, hw.gpus_per_node, accelerate_yaml)) + "\n")
    print("Recipe (ultrascale train FILE):\n"
          + _indent(render.recipe(best, args.gpus, hw.gpus_per_node, fields, args.seq_len,
                                  args.global_batch_size)))
    if args.plot:
        print(f"\nultrascale: wrote {args.plot}")
    return 0


def _header(args, cost) -> dict:
    """The inputs ``--json`` repeats before the layouts: model, cluster, workload (and the adapters with --peft)."""
    header = {"model": str(args.model), "params": cost.spec.total_params, "active_params": cost.spec.active_params,
              "gpus": args.gpus, "hardware": dataclasses.asdict(cost.hw), "seq_len": args.seq_len,
              "global_batch_size": args.global_batch_size, "profile": args.profile, "optimizer": args.optimizer,
              "memory_margin": args.memory_margin}
    adapters = cost.work.adapters
    if adapters is not None:
        header["peft"] = {"method": adapters.method, "r": adapters.r, **({"quantized": adapters.quantized}
                                                                         if adapters.quantized else {}),
                          "target": adapters.target if isinstance(adapters.target, str) else list(adapters.target)}
        header["trainable_params"] = cost.spec.trainable_params(adapters)
    return header


def _dry_run_candidates(args, cost, results) -> list[dict]:
    """``--dry-run`` without ``--layout``: the first ``--dry-run-top`` runnable candidates, each run once on fake
    tensors (``dry_run_candidates``)."""
    from .dry_run_candidates import check_candidates

    _refuse_for_dry_run(args, cost)
    return check_candidates(cost, results, args.gpus, args.seq_len, args.dry_run_top, routing=args.routing)


def _refuse_for_dry_run(args, cost) -> None:
    """A ``ConfigError`` for a plan flag the dry run does not run (its layout fields refuse themselves)."""
    for flag, value, runs in (("--peft", cost.work.adapters, None), ("--profile", args.profile, "ultrascale"),
                              ("--optimizer", args.optimizer, "adamw")):
        if value != runs:
            raise ConfigError(f"{flag} {value if runs else args.peft}: the dry run does not run this yet (it runs "
                              f"this package's code with AdamW on a full model). Fix: drop {flag}")


def _dry_run(args, cost) -> int:
    """``--dry-run``: ``us.dry_run`` of the ``--layout`` on the model ``plan`` loaded; the table, or ``--json``."""
    import json

    from ..core.dry_run import dry_run
    from .cost import layout_from_string

    if not args.layout:
        raise ConfigError(f"--dry-run-top {args.dry_run_top}: must be at least 1 without --layout. Fix: --dry-run-top "
                          "3, or give one layout with --layout")
    _refuse_for_dry_run(args, cost)
    lay = layout_from_string(args.layout, args.gpus, cost.pm).replace(mixed_precision=cost.work.precision)
    report = dry_run(cost.spec.config, lay.config(), world_size=args.gpus, seq_len=args.seq_len,
                     micro_batch_size=lay.micro_batch_size, grad_accum=lay.grad_accum, routing=args.routing)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.table())
    return 0


def _room_elsewhere(args, cost, results):
    """For a searched first choice that fits only at the edge: where the margin is found (``search.room_elsewhere``),
    else None."""
    from .headroom import has_headroom
    from .search import room_elsewhere

    best = results[0]
    if args.layout or args.memory_margin <= 0 or not best.fits or has_headroom(best, cost.hw.memory_gb,
                                                                                 args.memory_margin):
        return None
    return room_elsewhere(cost, args.gpus, results, args.memory_margin)


TITLES = {"mesh": "Mesh (axes in order, views):", "transforms": "Stages, in the order parallelize applies them:",
          "step hooks": "Step hooks, each with its plugins in call order:",
          "cost chain": "Cost chain (ultrascale_cost_estimate), in the order it runs:"}


def _explain(result, cost, gpus: int) -> str:
    """``--explain``: the chosen layout as ``us.describe`` says it (``engine.describe_parts``), each part under
    its title."""
    from ..core.engine import describe_parts

    try:
        parts = describe_parts(result.layout.config(), cost.spec.config, world_size=gpus)
    except ConfigError as exc:  # a layout this engine cannot run (listed with --all)
        return f"{TITLES['transforms']}\n    not runnable by this engine: {exc}"
    return "\n\n".join(f"{TITLES[name]}\n{_indent(body)}" for name, body in parts.items())


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())

"""The ``ultrascale`` command: ``train`` a recipe (the embedded default without one), list ``plugins``."""
from __future__ import annotations

import argparse
import os
import sys

from .. import _freeze_at_exit, _timing_mark, quiet_known_warnings
from ..distributed.supervisor import (STOP_FILE_ENV, TORCHRUN, TORCHRUN_DEFAULT_GRACE_S, Supervisor, end_by_signal,
                                      free_port)
from ..interface.config import ConfigError
from ..planner.memory_check import check_memory


def shutdown_timeout(grace: int) -> list[str]:
    """torchrun's flag for ``train.signal_grace_s``; a torch whose torchrun has no such flag waits 30 s, so any
    other grace is refused there, before launch."""
    from torch.distributed.run import get_args_parser

    try:
        supported = "shutdown_timeout" in vars(get_args_parser().parse_args(["-"]))
    except SystemExit:  # torchrun's own PET_* variables malformed: it says so itself when it starts
        supported = False
    if supported:
        return ["--shutdown-timeout", str(grace)]
    if grace != TORCHRUN_DEFAULT_GRACE_S:
        import torch

        raise ConfigError(f"train.signal_grace_s={grace}: torch {torch.__version__}'s torchrun has no "
                          f"--shutdown-timeout and kills the workers {TORCHRUN_DEFAULT_GRACE_S} s after a signal. Fix: "
                          f"set train.signal_grace_s: {TORCHRUN_DEFAULT_GRACE_S}, or use a torch whose torchrun has "
                          "--shutdown-timeout")
    return []


def check_recipe(recipe, init_from: str | None = None, nnodes: int = 1, memory_gb: float | None = None) -> str:
    """Every check that can run before a worker starts: recipe keys and types, pretrained weights, layout vs
    world size and model, batch vs data-parallel degree, memory (against ``memory_gb`` per process when given,
    e.g. a GPU the recipe is planned for; else this machine's). Returns the fingerprint of the module-tree checks
    that passed (``engine.validated_fingerprint``; empty when it cannot be taken), which the workers are handed
    so they do not repeat them."""
    from ..core.engine import validate, validate_loop, validated_fingerprint

    if not recipe.data.dataset:
        from ..data.corpus import check_corpus

        check_corpus(recipe.data.corpus, recipe.data.seq_len)
    model_config = recipe.model_config()
    model = None
    if init_from:
        from ..checkpoints.load import prepare

        weights, model = prepare(init_from, **recipe.base_dtype())
        model_config = model.config
        if model_config.vocab_size < 256 and not recipe.data.dataset:
            raise ConfigError(f"--init-from {init_from}: vocab_size={model_config.vocab_size}, but the byte-level "
                              "corpus uses token ids up to 255. Fix: use a model with a vocabulary of 256 or more")
    if model is None:  # the module tree on the meta device: what the plans and the structure rule out
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # a PEFT recipe's frozen base in its dtype (bf16 by default), as the workers'
            model = AutoModelForCausalLM.from_config(model_config, **recipe.base_dtype())
    if recipe.sections:  # the worker's model with the sections applied (PEFT's adapters), on the meta device
        model = recipe.apply_sections(model)
        if init_from:  # the adapters' names resolved against the files, as the workers will
            from ..checkpoints.load import weights_for

            weights_for(model, init_from)
    resolved = validate(recipe.parallel, model_config, recipe.nproc * nnodes, model=model)
    if recipe.train.global_batch % resolved.dp:
        raise ConfigError(f"train.global_batch={recipe.train.global_batch} is not divisible by the data-parallel "
                          f"degree {resolved.dp}. Fix: use a multiple of {resolved.dp}")
    t = recipe.train
    validate_loop(resolved, t.grad_accum or 1, t.max_grad_norm)  # train.grad_accum, train.max_grad_norm
    check_memory(resolved, model_config, model, recipe.nproc * nnodes, recipe.data.seq_len, t.micro_batch_size or 1,
                 t.grad_accum or 1, recipe.nproc, memory_gb, optimizer=t.optimizer)
    if t.optimizer != "adamw" or t.bf16_stochastic_round:  # torchao is there, before any worker needs it
        from .loop import check_optimizer

        check_optimizer(t.optimizer, t.bf16_stochastic_round, resolved)
    try:
        return validated_fingerprint(resolved, recipe.nproc * nnodes, model)
    except Exception:  # noqa: BLE001 - a config that does not serialize: the workers run the checks themselves
        return ""


def cmd_train(args) -> int:
    supervisor = Supervisor()  # first: a signal at any point ends what was started, and the command, quietly
    try:
        return _train(args, supervisor)
    finally:
        supervisor.restore()


def _train(args, supervisor: Supervisor) -> int:
    from ..data.recipe import load_recipe

    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"nproc={args.nproc}")
    nodes = _check_nodes(args)
    resume = _resume_path(args.resume) if args.resume else None
    recipe = load_recipe(args.recipe, overrides, nnodes=nodes, init_from=args.init_from,  # nproc is per node
                         resume_from=resume)
    _timing_mark("recipe_loaded")
    steps = recipe.train.steps
    if args.profile_step < 0 or (not recipe.train.epochs and args.profile_step > steps):
        raise ConfigError(f"--profile-step={args.profile_step}: the run has {steps} optimizer steps. Fix: give a "
                          f"step from 1 to {steps}, or leave --profile-step out")
    _model_line(args, overrides, recipe)
    if args.dry_run:  # one step at the recipe's full size and world, in this process, on fake tensors; no worker
        from . import dry_run

        return dry_run.run(args, recipe, nodes)
    validated = check_recipe(recipe, args.init_from, nodes)
    _timing_mark("checks_done")
    from ..data.recipe_data import prepare_before_launch

    data_line = prepare_before_launch(recipe, recipe.model_config(), resume)  # tokenized once per node
    if data_line:
        print(data_line, flush=True)
    _timing_mark("data_prepared")
    worker = [sys.executable, "-m", "ultrascale_plugins.cli.train"]
    if args.recipe:
        worker.append(os.path.abspath(args.recipe))
    for item in overrides:
        worker += ["--set", item]
    if args.metrics:
        worker += ["--metrics", os.path.abspath(args.metrics)]
    if args.log_dir:
        worker += ["--log-dir", os.path.abspath(args.log_dir)]
    if args.profile_step:
        worker += ["--profile-step", str(args.profile_step)]
    if resume:
        worker += ["--resume", resume]
    if args.init_from:
        worker += ["--init-from", os.path.abspath(args.init_from)]
    import tempfile

    from ..core.engine import VALIDATED_ENV

    with tempfile.TemporaryDirectory(prefix="ultrascale-") as tmp:
        error_file = os.path.join(tmp, "error")  # a worker's ConfigError, said once here rather than once per rank
        stop_file = os.path.join(tmp, "stopped")  # how the workers stopped on a signal, said once here
        env = {**os.environ, "ULTRASCALE_ERROR_FILE": error_file, STOP_FILE_ENV: stop_file}
        env.pop(VALIDATED_ENV, None)
        if validated:  # the module-tree checks passed here: the workers skip their meta-device dry runs
            env[VALIDATED_ENV] = validated
        code = _launch(args, recipe, nodes, worker, env, supervisor)
        _timing_mark("workers_exited")
        # one command per rank under another launcher: rank 0's says it (each says when its worker was killed)
        stopped = supervisor.signum and supervisor.line(stop_file, quiet=os.environ.get("RANK", "0") != "0")
        if code and not supervisor.signum and os.path.isfile(error_file):
            if os.environ.get("RANK", "0") != "0":  # one command per rank: rank 0's says it
                return 2
            raise ConfigError(open(error_file).read().strip())
    if supervisor.signum:
        if stopped:
            print(stopped, file=sys.stderr, flush=True)
        end_by_signal(supervisor.signum)
    return code


def _launch(args, recipe, nodes: int, worker: list[str], env: dict, supervisor: Supervisor) -> int:
    """Start the workers (torchrun for several local processes; the worker itself for one, or under a launcher that
    started this command once per rank) under ``supervisor`` and return their exit status."""
    grace = recipe.train.signal_grace_s
    supervisor.save_on_signal = recipe.train.save_on_signal
    if "RANK" in os.environ:  # already under torchrun / SLURM: its signals reach the worker (our process group) too
        return supervisor.run(worker, env, grace, own_session=False, error_file=env["ULTRASCALE_ERROR_FILE"])
    if recipe.nproc == 1:  # one process: in a session of its own, so that each signal reaches it once, through us
        return supervisor.run(worker, env, grace, own_session=True, error_file=env["ULTRASCALE_ERROR_FILE"])
    if nodes == 1:
        rendezvous = ["--nnodes", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    else:  # torchrun's static rendezvous: this node's ranks are node_rank x nproc + local rank, as given
        rendezvous = ["--nnodes", str(nodes), "--node_rank", str(args.node_rank), "--rdzv_backend", "static",
                      "--rdzv_endpoint", args.rdzv_endpoint]
    launcher = [sys.executable, "-c", TORCHRUN, "--nproc_per_node", str(recipe.nproc), *rendezvous,
                *shutdown_timeout(grace), "--max_restarts", "0", "--module", "ultrascale_plugins.cli.train", *worker[3:]]
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOGLEVEL", "ERROR")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    _timing_mark("spawn")
    # torchrun's report of the workers that failed on a configuration error is dropped: the error is said once here
    return supervisor.run(launcher, env, grace, own_session=True, error_file=env["ULTRASCALE_ERROR_FILE"])


def _resume_path(path: str) -> str:
    """The checkpoint ``--resume`` names (a step-XXXXXXXX directory, or a save_dir: its newest), checked before any
    worker starts: missing, incomplete, truncated checkpoints and a malformed ultrascale.json are refused, and the
    shared files' checksums verified (small); the shards and rank-local files, one per rank, are verified by the
    workers, each rank its share, in parallel (``checkpoints/checksums.py``)."""
    from ..checkpoints.checksums import check, shared
    from ..checkpoints.sharded import META, read_meta, resolve_checkpoint

    resume = resolve_checkpoint(os.path.abspath(path))
    if not (resume / META).is_file():
        raise ConfigError(f"--resume {path}: no complete checkpoint there. Fix: pass a step-XXXXXXXX "
                          "directory or a save_dir holding one")
    meta = read_meta(resume)
    check(resume, meta, shared(meta.get("files", {})))  # sizes only with ULTRASCALE_SKIP_CHECKSUMS=1
    return str(resume)


def _model_line(args, overrides: list[str], recipe) -> None:
    """One line saying where the model's sizes come from, when the recipe does not give them all: the checkpoint
    (--resume without --init-from), or transformers' defaults for what the model section leaves out; with
    --init-from, one line naming the recipe's model keys that config.json overrides (sizes were refused before)."""
    from ..data.recipe import compare_with_checkpoint, compare_with_pretrained, defaulted_sizes, own_model_section

    config = recipe.model_config()
    own = own_model_section(args.recipe, overrides, recipe.model)
    if recipe.resume_from:
        sizes = ", ".join(f"{k}={getattr(config, k)}" for k in ("hidden_size", "num_hidden_layers", "vocab_size")
                          if getattr(config, k, None) is not None)
        other = compare_with_checkpoint(own, config, f"--resume {args.resume}")
        ignored = f"; the recipe's {'; '.join(other)} is not used" if other else ""
        print(f"ultrascale: model: {config.model_type} ({sizes}) as saved in {recipe.resume_from} (--resume "
              f"without --init-from: the checkpoint's config is the model){ignored}", flush=True)
    elif recipe.init_from:
        other = compare_with_pretrained(own, config, f"--init-from {args.init_from}") if own else []
        if other:
            where = os.path.join(args.init_from, "config.json")
            print(f"ultrascale: model: {where} is the model (--init-from); the recipe's {'; '.join(other)} is not "
                  "used", flush=True)
    else:
        left = defaulted_sizes(recipe.model, config)
        if left:
            print(f"ultrascale: the recipe's model section leaves {', '.join(f'{k}={v}' for k, v in left.items())} "
                  f"at transformers' {config.model_type} defaults (set them in model: to change them)", flush=True)


def _check_nodes(args) -> int:
    """The node count, after checking the multi-node flags together (before any worker starts)."""
    nodes = args.nnodes
    if nodes < 1:
        raise ConfigError(f"--nnodes {nodes}: must be at least 1. Fix: e.g. --nnodes 2")
    if nodes > 1 and not args.rdzv_endpoint and not getattr(args, "dry_run", False):
        raise ConfigError(f"--nnodes {nodes} needs --rdzv-endpoint HOST:PORT (the first node's address, the same on "
                          "every node). Fix: add e.g. --rdzv-endpoint node001:29500")
    if not 0 <= args.node_rank < nodes:
        raise ConfigError(f"--node-rank {args.node_rank}: must be 0 to {nodes - 1} for --nnodes {nodes}. Fix: number "
                          "the nodes from 0")
    if nodes > 1 and "RANK" in os.environ:
        raise ConfigError("--nnodes with a launcher that already started the workers (RANK is set). Fix: leave the "
                          "node flags to that launcher")
    return nodes


def cmd_plugins(args) -> int:
    from ..core.registry import default_registry

    rows = default_registry().plugins()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['source']} {r['version']}")
        print(f"{'':<{width}}  hooks: {', '.join(r['hooks'])}")
        for f in r["fields"]:
            choices = f" ({'|'.join(map(str, f.choices))})" if f.choices else ""
            print(f"{'':<{width}}  field {f.name}: {f.type.__name__} = {f.default!r}{choices}  {f.help}")
    return 0


def cmd_export(args) -> int:
    from ..checkpoints.export import export_form, export_hf

    max_shard_bytes = int(args.max_shard_gb * 2**30)
    if args.base is not None and not args.merged:
        raise ConfigError("--base DIR is the frozen base for --merged. Fix: add --merged, or drop --base")
    if args.adapter or args.merged:
        form = "adapter" if args.adapter else "merged"
        out = export_form(args.checkpoint, args.out_dir, form, base=args.base, max_shard_bytes=max_shard_bytes)
        how = "PeftModel.from_pretrained(base, dir)" if args.adapter else "AutoModelForCausalLM.from_pretrained"
        print(f"ultrascale: wrote {out} (load it with {how})")
        return 0
    out = export_hf(args.checkpoint, args.out_dir, max_shard_bytes=max_shard_bytes)
    print(f"ultrascale: wrote {out} (load it with AutoModelForCausalLM.from_pretrained)")
    return 0


def _ask(prompt: str, kind, default):
    answer = input(f"{prompt} [{default}]: ").strip()
    if not answer:
        return default
    if kind is bool:
        return answer.lower() in ("1", "true", "yes", "y")
    try:
        return kind(answer)
    except ValueError:
        raise ConfigError(f"{prompt} {answer!r}: must be {kind.__name__}. Fix: answer e.g. {default}") from None


def _ask_layout() -> dict:
    """The layout fields the installed plugins ask for (``Field.ask``), in their declaration order, each only
    when the answers so far make it matter (``pp_schedule`` once ``pp`` > 1); each answer checked as a recipe's
    value is."""
    from ..core.registry import default_registry

    answers: dict = {}
    for field in default_registry().fields:
        if field.asked(answers):
            answers[field.name] = field.validate(_ask(field.prompt(), field.type, field.default))
    return answers


def cmd_accelerate_config(args) -> int:
    """Write an Accelerate config file that holds the whole layout."""
    import yaml

    from ..interface.config import ParallelConfig
    from ..integrations.layout import accelerate_yaml
    from ..data.recipe import apply_overrides

    fields = apply_overrides({}, args.overrides).get("parallel", {}) if args.overrides else {}
    num_processes = args.num_processes
    if args.interactive:
        num_processes = _ask("How many processes in all (all machines)?", int, 2)
        fields.update(_ask_layout())
    if num_processes is None:
        raise ConfigError("--num-processes is required (or --interactive). Fix: e.g. --num-processes 4")
    config = ParallelConfig.from_dict(fields)
    from ..core.engine import validate

    if args.model_type is None:
        config.resolve(num_processes)
    else:
        from transformers import AutoConfig

        validate(config, AutoConfig.for_model(args.model_type), num_processes)
    use_cpu = args.cpu if args.cpu is not None else not _has_gpu()
    data = accelerate_yaml(config, num_processes, use_cpu, args.num_machines)
    out = args.out
    with open(out, "w") as f:
        f.write("# Accelerate config written by `ultrascale accelerate-config`. Standard keys mean what they mean in\n"
                "# Accelerate; the `ultrascale` block holds the fields Accelerate has no key for. Launch with\n"
                f"#   ultrascale accelerate-launch {out} train.py      (or ULTRASCALE_CONFIG={out} accelerate launch "
                f"--config_file {out} train.py)\n")
        yaml.safe_dump(data, f, sort_keys=False)
    print(f"ultrascale: wrote {out}")
    return 0


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def cmd_accelerate_launch(args) -> int:
    """``accelerate launch --config_file F script`` with ``ULTRASCALE_CONFIG=F``, after checking F. A configuration
    error a worker finds (its model against the layout, ...) is said here once too, with exit status 2
    (``integrations/launcher.py``)."""
    import yaml

    from ..integrations.launcher import run_accelerate_launch
    from ..integrations.layout import read_layout_file

    config = read_layout_file(args.config_file)
    data = yaml.safe_load(open(args.config_file)) or {}
    num_processes = int(data.get("num_processes", 1))
    try:
        config.resolve(num_processes)
    except ConfigError as exc:
        raise ConfigError(f"{args.config_file} (num_processes: {num_processes}): {exc}") from None
    env = {**os.environ, "ULTRASCALE_CONFIG": os.path.abspath(args.config_file)}
    env.setdefault("OMP_NUM_THREADS", "1")
    return run_accelerate_launch(["--config_file", args.config_file, args.script, *args.script_args], env)


def cmd_plan(args) -> int:
    """Cost layouts of a model on a cluster and print the best (``planner``)."""
    from ..integrations.layout import accelerate_yaml
    from ..planner.command import run_plan

    return run_plan(args, accelerate_yaml)


def cmd_calibrate(args) -> int:
    """Measure this machine and write a hardware profile for ``--gpu FILE`` (``planner.calibrate``)."""
    from ..planner.calibrate import run_calibrate

    return run_calibrate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ultrascale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a recipe (the embedded default when none is given)")
    train.add_argument("recipe", nargs="?", help="recipe YAML; omit for the embedded default")
    train.add_argument("--nproc", type=int, help="processes on this machine (overrides the recipe's nproc)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field: tp=2, train.steps=20, model.hidden_size=64")
    train.add_argument("--nnodes", type=int, default=1, help="machines in the job (the recipe's nproc is per node)")
    train.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 to nnodes - 1")
    train.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the first node's address, the same everywhere")
    train.add_argument("--metrics", help="write losses and throughput as JSON to this file")
    train.add_argument("--log-dir", help="append a JSON line per logged step (loss, learning rate, gradient norm, "
                       "tokens/s, peak memory per rank) to DIR/metrics.jsonl, and TensorBoard event files to DIR "
                       "(with the tensorboard extra installed)")
    train.add_argument("--profile-step", type=int, default=0, metavar="N",
                       help="record every collective of optimizer step N (1 = the first) on every rank and print, "
                            "once, its bytes per mesh axis beside the package's estimate and the layout's minimum")
    train.add_argument("--resume", metavar="PATH",
                       help="continue from a checkpoint (a step-XXXXXXXX directory, or a save_dir: its newest); "
                            "the layout may differ from the one it was saved in; without --init-from the model is "
                            "the one the checkpoint holds")
    train.add_argument("--init-from", metavar="HF_DIR",
                       help="start from pretrained weights (a save_pretrained directory, safetensors); the model "
                            "section of the recipe may be left out: its config.json is the model (a model section must "
                            "agree with it in every size); each rank reads only its shards")
    train.add_argument("--dry-run", action="store_true",
                       help="start no worker: run one optimizer step of the recipe at its full size and world size "
                            "(nproc x --nnodes) in this process on fake tensors, and print its peak memory by "
                            "category per rank role, the bytes per mesh axis and the planner's estimate beside them "
                            "(--metrics FILE: the report as JSON)")
    train.set_defaults(func=cmd_train)
    export = sub.add_parser("export", help="write a Hugging Face directory from a sharded checkpoint")
    export.add_argument("checkpoint", help="a step-XXXXXXXX checkpoint directory (any layout)")
    export.add_argument("out_dir", help="a new (or empty) directory")
    export.add_argument("--max-shard-gb", type=float, default=2.0, help="size of each safetensors file")
    form = export.add_mutually_exclusive_group()
    form.add_argument("--adapter", action="store_true",
                      help="a PEFT model's checkpoint: write its adapters in PEFT's files (adapter_config.json, "
                           "adapter_model.safetensors) for PeftModel.from_pretrained(base, dir)")
    form.add_argument("--merged", action="store_true",
                      help="a PEFT model's checkpoint: write a plain transformers model with the adapters merged "
                           "into the frozen base (read from --base, checked against the checkpoint's fingerprint)")
    export.add_argument("--base", metavar="DIR",
                        help="with --merged: the pretrained base the run was built on (a save_pretrained directory "
                             "or a Hub id); default: the --init-from the checkpoint's run started from, else the "
                             "base_model_name_or_path PEFT recorded")
    export.set_defaults(func=cmd_export)
    acfg = sub.add_parser("accelerate-config", help="write an Accelerate config file holding a whole layout")
    acfg.add_argument("--out", default="ultrascale_accelerate.yaml", help="the file to write")
    acfg.add_argument("--num-processes", type=int, help="processes in all (all machines)")
    acfg.add_argument("--num-machines", type=int, default=1)
    acfg.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                      help="a layout field: pp=2, tp=2, sequence_parallel=true, pp_schedule=zbv, ...")
    acfg.add_argument("--cpu", action="store_true", default=None, help="run on CPU (default: when no GPU)")
    acfg.add_argument("--model-type", help="check the layout against this model type's default config too")
    acfg.add_argument("--interactive", action="store_true", help="ask for each setting")
    acfg.set_defaults(func=cmd_accelerate_config)
    alaunch = sub.add_parser("accelerate-launch", help="accelerate launch a script with a file from accelerate-config")
    alaunch.add_argument("config_file")
    alaunch.add_argument("script")
    alaunch.add_argument("script_args", nargs=argparse.REMAINDER)
    alaunch.set_defaults(func=cmd_accelerate_launch)
    plan = sub.add_parser("plan", help="predict memory and throughput of layouts on a cluster; print the best")
    from ..planner.command import add_arguments

    add_arguments(plan)
    plan.set_defaults(func=cmd_plan)
    calibrate = sub.add_parser("calibrate", help="measure this machine (matmuls, memory, collectives) and write a "
                               "hardware profile that ultrascale plan --gpu FILE accepts")
    from ..planner.calibrate import add_arguments as calibrate_arguments

    calibrate_arguments(calibrate)
    calibrate.set_defaults(func=cmd_calibrate)
    plugins = sub.add_parser("plugins", help="list installed plugins, their versions and hooks")
    plugins.set_defaults(func=cmd_plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    _timing_mark("cli_main")
    _freeze_at_exit()
    quiet_known_warnings()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"ultrascale: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

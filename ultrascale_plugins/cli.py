"""The ``ultrascale`` command: ``train`` a recipe (the embedded default without one), list ``plugins``."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

from .config import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_recipe(recipe, init_from: str | None = None) -> None:
    """Every check that can run before a worker starts: recipe keys and types, pretrained weights, layout vs
    world size and model, batch vs data-parallel degree."""
    from .engine import validate

    model_config = recipe.model_config()
    if init_from:
        from .pretrained import prepare

        weights, model = prepare(init_from)
        model_config = model.config
        if model_config.vocab_size < 256:
            raise ConfigError(f"--init-from {init_from}: vocab_size={model_config.vocab_size}, but the byte-level "
                              "corpus uses token ids up to 255. Fix: use a model with a vocabulary of 256 or more")
    resolved = validate(recipe.parallel, model_config, recipe.nproc)
    if recipe.train.global_batch % resolved.dp:
        raise ConfigError(f"train.global_batch={recipe.train.global_batch} is not divisible by the data-parallel "
                          f"degree {resolved.dp}. Fix: use a multiple of {resolved.dp}")


def cmd_train(args) -> int:
    from .recipe import load_recipe

    overrides = list(args.overrides)
    if args.nproc is not None:
        overrides.append(f"nproc={args.nproc}")
    recipe = load_recipe(args.recipe, overrides)
    check_recipe(recipe, args.init_from)
    worker = [sys.executable, "-m", "ultrascale_plugins.train"]
    if args.recipe:
        worker.append(os.path.abspath(args.recipe))
    for item in overrides:
        worker += ["--set", item]
    if args.metrics:
        worker += ["--metrics", os.path.abspath(args.metrics)]
    if args.resume:
        from .checkpoint import list_checkpoints, read_meta

        resume = os.path.abspath(args.resume)
        if not os.path.exists(os.path.join(resume, "ultrascale.json")):
            found = list_checkpoints(resume)
            if not found:
                raise ConfigError(f"--resume {args.resume}: no complete checkpoint there. Fix: pass a step-XXXXXXXX "
                                  "directory or a save_dir holding one")
            resume = str(found[-1])
        read_meta(resume)  # missing, incomplete or truncated: refused before any worker starts
        worker += ["--resume", resume]
    if args.init_from:
        worker += ["--init-from", os.path.abspath(args.init_from)]
    if "RANK" in os.environ or recipe.nproc == 1:  # already under torchrun / SLURM, or one process
        return subprocess.call(worker)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(recipe.nproc),
                "--nnodes", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{_free_port()}",
                "--max_restarts", "0", "--module", "ultrascale_plugins.train", *worker[3:]]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("LOGLEVEL", "ERROR")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return subprocess.call(launcher, env=env)


def cmd_plugins(args) -> int:
    from .plugins import list_plugins

    rows = list_plugins()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['source']} {r['version']}")
        print(f"{'':<{width}}  hooks: {', '.join(r['hooks'])}")
    return 0


def cmd_export(args) -> int:
    from .export import export_hf

    out = export_hf(args.checkpoint, args.out_dir, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"ultrascale: wrote {out} (load it with AutoModelForCausalLM.from_pretrained)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ultrascale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a recipe (the embedded default when none is given)")
    train.add_argument("recipe", nargs="?", help="recipe YAML; omit for the embedded default")
    train.add_argument("--nproc", type=int, help="processes on this machine (overrides the recipe's nproc)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field: tp=2, train.steps=20, model.hidden_size=64")
    train.add_argument("--metrics", help="write losses and throughput as JSON to this file")
    train.add_argument("--resume", metavar="PATH",
                       help="continue from a checkpoint (a step-XXXXXXXX directory, or a save_dir: its newest); "
                            "the layout may differ from the one it was saved in")
    train.add_argument("--init-from", metavar="HF_DIR",
                       help="start from pretrained weights (a save_pretrained directory, safetensors); the model "
                            "section of the recipe is replaced by its config.json; each rank reads only its shards")
    train.set_defaults(func=cmd_train)
    export = sub.add_parser("export", help="write a Hugging Face directory from a sharded checkpoint")
    export.add_argument("checkpoint", help="a step-XXXXXXXX checkpoint directory (any layout)")
    export.add_argument("out_dir", help="a new (or empty) directory")
    export.add_argument("--max-shard-gb", type=float, default=2.0, help="size of each safetensors file")
    export.set_defaults(func=cmd_export)
    plugins = sub.add_parser("plugins", help="list installed plugins, their versions and hooks")
    plugins.set_defaults(func=cmd_plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"ultrascale: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

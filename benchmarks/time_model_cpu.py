"""The calibrated time model against measured steps on this machine: for each layout of one small model on 2 CPU
processes (gloo), the planner's predicted step time (``ultrascale plan --gpu PROFILE --layout L``'s own costing:
``planner.command.build`` and ``CostModel.evaluate``) beside the step time the engine ``ultrascale train`` runs
measures (its recipe loaded by ``load_recipe``, the model built by ``build_model``, each step the training loop's:
``accumulate_step``, clipping, the optimizer's step; the median of the steps after two warm-up steps).

    python benchmarks/time_model_cpu.py --out benchmarks/results/time_model_cpu.json          # calibrates first
    python benchmarks/time_model_cpu.py --profile hw.json --rounds 1 --steps 3                  # a quick look

Every cell is measured in each of ``--rounds`` rounds, the layouts in turn inside a round (and in reverse order in
odd rounds), so machine noise hits all alike; the load average is kept at each round: the machine is shared. Each
round is calibrated just before its steps (``ultrascale calibrate``, unless ``--profile`` gives one profile for
all), so that a round's prediction and its measurement see the same load. Two
models: a dense Llama for every layout but expert parallelism, a Qwen3-MoE of the same widths for it (and beside
it, its data-parallel layout). Reported: per cell the prediction, the median of the rounds' medians and its spread
(min/max of the rounds' medians), then over all cells the median |error|, Spearman's rho and whether the measured
fastest layout is among the planner's three fastest.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ, GLOBAL_BATCH, WORLD = 256, 8, 2
DENSE = dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, max_position_embeddings=SEQ,
             tie_word_embeddings=False)
MOE = dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=1024, moe_intermediate_size=256,
           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096,
           num_experts=8, num_experts_per_tok=2, max_position_embeddings=SEQ, tie_word_embeddings=False)
LORA = {"r": 16, "target_modules": "all-linear"}
# (name, model, the planner's --layout, LoRA adapters)
CELLS = [
    ("ddp", "dense", "dp=2,zero=0,mbs=4,ga=1", None),
    ("ddp_ga2", "dense", "dp=2,zero=0,mbs=2,ga=2", None),
    ("zero1", "dense", "dp=2,zero=1,mbs=4,ga=1", None),
    ("zero1_ga2", "dense", "dp=2,zero=1,mbs=2,ga=2", None),
    ("zero2_ga2", "dense", "dp=2,zero=2,mbs=2,ga=2", None),
    ("zero3", "dense", "dp=2,zero=3,mbs=4,ga=1", None),
    ("zero3_ga2", "dense", "dp=2,zero=3,mbs=2,ga=2", None),
    ("zero3_ga4", "dense", "dp=2,zero=3,mbs=1,ga=4", None),
    ("zero3_recompute", "dense", "dp=2,zero=3,mbs=4,ga=1,recompute=full", None),
    ("zero3_offload", "dense", "dp=2,zero=3,mbs=4,ga=1,cpu_offload=true", None),
    ("tp2", "dense", "dp=1,tp=2,sp=false,mbs=4,ga=2", None),
    ("tp2_sp", "dense", "dp=1,tp=2,sp=true,mbs=4,ga=2", None),
    ("pp2_1f1b", "dense", "dp=1,pp=2,schedule=1f1b,mbs=2,ga=4", None),
    ("pp2_gpipe", "dense", "dp=1,pp=2,schedule=gpipe,mbs=2,ga=4", None),
    ("pp2_interleaved", "dense", "dp=1,pp=2,schedule=interleaved_1f1b,virtual=2,mbs=2,ga=4", None),
    ("pp2_zbv", "dense", "dp=1,pp=2,schedule=zbv,mbs=2,ga=4", None),
    ("cp2_ring", "dense", "dp=1,cp=2,cp_method=ring,mbs=4,ga=2", None),
    ("cp2_ulysses", "dense", "dp=1,cp=2,cp_method=ulysses,mbs=4,ga=2", None),
    ("lora_ddp", "dense", "dp=2,zero=0,mbs=4,ga=1", LORA),
    ("lora_zero3", "dense", "dp=2,zero=3,mbs=4,ga=1", LORA),
    ("moe_zero3", "moe", "dp=2,zero=3,mbs=4,ga=1", None),
    ("moe_ep2", "moe", "dp=2,zero=3,ep=2,mbs=4,ga=1", None),
]
PRECISION = "bf16"


def plan_argv(model_dir: str, profile: str, layout: str, lora) -> list[str]:
    """The ``ultrascale plan`` arguments that cost one cell."""
    argv = ["--model", model_dir, "--gpus", str(WORLD), "--gpu", profile, "--seq-len", str(SEQ),
            "--global-batch-size", str(GLOBAL_BATCH), "--precision", PRECISION, "--layout", layout]
    if lora:
        argv += ["--peft", "lora", "--lora-r", str(lora["r"])]
    return argv


def predict(model_dirs: dict, profile: str) -> dict:
    """{cell: the planner's step time and its parts}, as ``ultrascale plan --layout`` costs it."""
    from ultrascale_plugins.planner.command import add_arguments, build
    from ultrascale_plugins.planner.cost import layout_from_string

    out = {}
    for name, model, layout, lora in CELLS:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(plan_argv(model_dirs[model], profile, layout, lora))
        cost = build(args)[0]
        lay = layout_from_string(args.layout, args.gpus, cost.pm).replace(mixed_precision=cost.work.precision)
        result = cost.evaluate(lay)
        out[name] = {"step_s": result.step_s, "times_s": result.times_s, "runnable": result.runnable}
    return out


# the constants a profile's step kernels add (calibration_fit.fit_step_kernels): without them, the time model as it
# was before it priced attention, the element-wise kernels and the optimizer apart (the "before" column)
STEP_CONSTANTS = ("attention_efficiency", "layer_call_s", "element_s", "optimizer_elements_s", "host_step_elements_s")


def matmuls_only(profile: str, out: Path) -> str:
    """``profile`` without the step kernels' constants, written to ``out``."""
    data = json.loads(Path(profile).read_text())
    data["constants"] = {k: v for k, v in data["constants"].items() if k not in STEP_CONSTANTS}
    out.write_text(json.dumps(data))
    return str(out)


def recipe_of(model: dict, layout: str, lora) -> dict:
    """The ``ultrascale train`` recipe of one cell: the planner's layout as the ``parallel:`` section."""
    from ultrascale_plugins.planner.cost import layout_from_string

    lay = layout_from_string(layout, WORLD)
    parallel = {**lay.fields(), "mixed_precision": PRECISION}
    parallel.pop("pp_microbatches", None)  # the recipe's grad_accum is the pipeline's micro-batches
    recipe = {"nproc": WORLD, "model": model, "data": {"seq_len": SEQ},
              "train": {"steps": 1, "global_batch": GLOBAL_BATCH, "micro_batch_size": lay.micro_batch_size,
                        "grad_accum": lay.grad_accum, "log_every": 1000, "warmup_steps": 0},
              "parallel": parallel}
    if lora:
        recipe["peft"] = dict(lora)
    return recipe


def measure_cell(recipe_path: str, steps: int) -> list[float]:
    """Step times of one cell on this rank's process group: the training loop's step, two warm-up steps first."""
    import torch
    import torch.distributed as dist

    from ultrascale_plugins.cli.loop import accumulate_step, make_optimizer, training_data
    from ultrascale_plugins.cli.model_build import build_model
    from ultrascale_plugins.data.recipe import load_recipe

    recipe = load_recipe(recipe_path, world_size=dist.get_world_size())
    torch.manual_seed(recipe.train.seed)
    pmodel = build_model(recipe, torch.device("cpu")).pmodel
    optimizer = make_optimizer(pmodel, recipe)
    recipe, data = training_data(recipe, pmodel)
    times = []
    for step in range(2 + steps):
        batch = data.train_rows(step, pmodel.data_parallel_rank, pmodel.data_parallel_size)
        dist.barrier()
        start = time.perf_counter()
        accumulate_step(pmodel, batch, recipe)
        pmodel.clip_grad_norm_(recipe.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - start)
    del pmodel, optimizer, data
    return times[2:]


def worker(args) -> None:
    """One rank of one round's measuring job: every cell in turn (in reverse with ``--reverse``); rank 0 writes
    the step times and the load average at the round's start and end."""
    import warnings

    import torch.distributed as dist

    import ultrascale_plugins as us

    warnings.filterwarnings("ignore")
    us.init_distributed(timeout=900)
    recipes = json.loads(Path(args.recipes).read_text())
    order = list(reversed(recipes)) if args.reverse else list(recipes)
    load = os.getloadavg()
    cells = {}
    for name in order:
        cells[name] = measure_cell(recipes[name], args.steps)
        if dist.get_rank() == 0:
            print(f"{name}: median {statistics.median(cells[name]):.3f} s", flush=True)
    if dist.get_rank() == 0:
        Path(args.measured).write_text(json.dumps({"loadavg_start": load, "loadavg_end": os.getloadavg(),
                                                   "order": order, "steps_s": cells}, indent=1))
    dist.destroy_process_group()


def summarize(rounds: list[dict], key: str = "predicted") -> dict:
    """Per cell: the prediction and the measured step (each the median over the rounds, every round's profile
    calibrated just before its steps were measured), their spread, the error; over all: median |error|, rho,
    top-3."""
    rows = {}
    for name, model, layout, lora in CELLS:
        medians = [statistics.median(r["steps_s"][name]) for r in rounds]
        predictions = [r[key][name]["step_s"] for r in rounds]
        measured, pred = statistics.median(medians), statistics.median(predictions)
        parts = rounds[0][key][name]["times_s"]
        rows[name] = {"model": model, "layout": layout, "peft": "lora" if lora else None,
                      "predicted_s": round(pred, 4), "measured_s": round(measured, 4),
                      "round_medians_s": [round(m, 4) for m in medians],
                      "round_predictions_s": [round(p, 4) for p in predictions],
                      "spread_s": [round(min(medians), 4), round(max(medians), 4)],
                      "error": round(pred / measured - 1, 4),
                      "predicted_parts_s_round0": {k: round(v, 4) for k, v in parts.items()}}
    names = list(rows)
    pred = [rows[n]["predicted_s"] for n in names]
    meas = [rows[n]["measured_s"] for n in names]
    from ultrascale_plugins.planner.validation import spearman

    fastest = min(names, key=lambda n: rows[n]["measured_s"])
    top3 = sorted(names, key=lambda n: rows[n]["predicted_s"])[:3]
    return {"cells": rows, "median_abs_error": round(statistics.median(abs(rows[n]["error"]) for n in names), 4),
            "spearman_rho": round(spearman(pred, meas), 4), "measured_fastest": fastest,
            "planner_top3": top3, "fastest_in_top3": fastest in top3}


def markdown(result: dict) -> str:
    s, b = result["summary"], result["summary_before"]
    lines = [f"# Calibrated time model vs measured steps ({result['date']}, {result['machine']})", "",
             f"Model: dense Llama {result['models']['dense']}; MoE {result['models']['moe']}; sequence {SEQ}, "
             f"global batch {GLOBAL_BATCH}, {WORLD} processes, {PRECISION}.", "",
             f"Command: `{result['command']}`", "",
             f"Median |error| **{s['median_abs_error']:.1%}**, Spearman rho **{s['spearman_rho']:.2f}**, measured "
             f"fastest `{s['measured_fastest']}` in the planner's top 3 ({', '.join(s['planner_top3'])}): "
             f"**{'yes' if s['fastest_in_top3'] else 'no'}**.", "",
             f"Before the step kernels were calibrated (the same profiles without {', '.join(STEP_CONSTANTS[:4])}): "
             f"median |error| {b['median_abs_error']:.1%}, rho {b['spearman_rho']:.2f}, fastest in top 3: "
             f"{'yes' if b['fastest_in_top3'] else 'no'}.", "",
             "Load average (1, 5, 15 min) at each round's start: "
             + "; ".join(f"{r['loadavg_start'][0]:.2f}/{r['loadavg_start'][1]:.2f}/{r['loadavg_start'][2]:.2f}"
                         for r in result["rounds"]) + " (the machine is shared with other work).", "",
             "| cell | layout (`ultrascale plan --layout`) | predicted s | measured s (median) | rounds min-max "
             "| error | before |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in s["cells"].items():
        layout = row["layout"] + (" --peft lora" if row["peft"] else "") + (" (MoE)" if row["model"] == "moe" else "")
        lines.append(f"| {name} | `{layout}` | {row['predicted_s']:.3f} | {row['measured_s']:.3f} | "
                     f"{row['spread_s'][0]:.3f}-{row['spread_s'][1]:.3f} | {row['error']:+.0%} | "
                     f"{b['cells'][name]['error']:+.0%} |")
    return "\n".join(lines) + "\n"


def repredict(args, tmp: Path, model_dirs: dict) -> None:
    """``--repredict``: an earlier run's rounds costed again, each with its own profile."""
    result = json.loads(Path(args.repredict).read_text())
    for r, rnd in enumerate(result["rounds"]):
        path = tmp / f"hw{r}.json"
        path.write_text(json.dumps(rnd["profile"]))
        rnd["predicted"] = predict(model_dirs, str(path))
        rnd["predicted_before"] = predict(model_dirs, matmuls_only(str(path), tmp / f"before{r}.json"))
    result["summary"] = summarize(result["rounds"])
    result["summary_before"] = summarize(result["rounds"], "predicted_before")
    write(result, args.out)


def write(result: dict, out: str | None) -> None:
    print(markdown(result))
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        Path(out).with_suffix(".md").write_text(markdown(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="a hardware profile from ultrascale calibrate (default: calibrate before "
                    "each round)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per cell and round, after two warm-up steps")
    ap.add_argument("--only", help="comma-separated cells (default: all)")
    ap.add_argument("--out", help="JSON results (a .md table beside it)")
    ap.add_argument("--repredict", metavar="JSON", help="cost an earlier run's rounds again with the planner as it is "
                    "now, each with the profile calibrated for it (the measurements and profiles kept)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--recipes", help=argparse.SUPPRESS)
    ap.add_argument("--measured", help=argparse.SUPPRESS)
    ap.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    global CELLS
    if args.only:
        CELLS = [c for c in CELLS if c[0] in args.only.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="time_model_cpu_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    import yaml

    model_dirs, recipes = {}, {}
    for key, model in (("dense", DENSE), ("moe", MOE)):
        (tmp / key).mkdir()
        (tmp / key / "config.json").write_text(json.dumps(model))
        model_dirs[key] = str(tmp / key)
    if args.repredict:
        return repredict(args, tmp, model_dirs)
    for name, model, layout, lora in CELLS:
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe_of(DENSE if model == "dense" else MOE, layout, lora)))
        recipes[name] = str(path)
    (tmp / "recipes.json").write_text(json.dumps(recipes))
    rounds = []
    for r in range(args.rounds):
        profile = args.profile
        if profile is None:  # calibrated just before the round's steps: under the same load
            profile = str(tmp / f"hw{r}.json")
            subprocess.run(["ultrascale", "calibrate", "--nproc", str(WORLD), "--out", profile], check=True, env=env)
        measured = tmp / f"measured{r}.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(WORLD), __file__, "--worker", "--recipes", str(tmp / "recipes.json"), "--measured",
                        str(measured), "--steps", str(args.steps), *(["--reverse"] if r % 2 else [])],
                       check=True, env=env)
        rounds.append({**json.loads(measured.read_text()), "profile": json.loads(Path(profile).read_text()),
                       "predicted": predict(model_dirs, profile),
                       "predicted_before": predict(model_dirs, matmuls_only(profile, tmp / f"before{r}.json"))})
    import torch

    result = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {WORLD} CPU processes (gloo, 1 thread "
                         f"each), torch {torch.__version__}",
              "command": "python benchmarks/time_model_cpu.py" + (f" --profile {args.profile}" if args.profile else "")
                         + f" --rounds {args.rounds} --steps {args.steps}",
              "models": {"dense": DENSE, "moe": MOE}, "seq_len": SEQ, "global_batch": GLOBAL_BATCH,
              "precision": PRECISION, "rounds": rounds, "summary": summarize(rounds),
              "summary_before": summarize(rounds, "predicted_before")}
    write(result, args.out)


if __name__ == "__main__":
    main()

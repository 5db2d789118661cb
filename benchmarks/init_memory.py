"""Peak host memory per rank while building and initializing a model from a config under ZeRO-3: the meta-device
path (``torch.device("meta")`` + ``load.weights_for`` -> ``initialize.ModelInit``: every rank allocates its
shards and draws one module at a time) vs the old way (``AutoModelForCausalLM.from_config`` on every rank, then
``parallelize``), in the same run.

Memory is the RSS high-water mark (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) of each rank after the model is
built and initialized, minus the same mark taken after the imports and the process group (the baseline). A
high-water mark never goes down, so every measurement is its own launch; the two methods alternate, ``--repeats``
launches each, and the figures are medians over the launches of the worst rank's rise (and of each rank's).

    python benchmarks/init_memory.py --repeats 3 --date 2026-12-04 --out benchmarks/results/init_memory.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=6,
              num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
              max_position_embeddings=2048)
NPROC = 4


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def worker(method: str, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: F401 (imported now)

    import ultrascale_plugins as us
    from ultrascale_plugins.checkpoints.load import weights_for

    warnings.filterwarnings("ignore")
    us.init_distributed(timeout=1800)
    config = LlamaConfig(**CONFIG)
    baseline = maxrss_mb()
    start = time.perf_counter()
    torch.manual_seed(0)
    if method == "meta":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        pmodel = us.parallelize(model, {"dp_shard": NPROC}, init_weights=weights_for(model, None))
    else:
        model = AutoModelForCausalLM.from_config(config)
        pmodel = us.parallelize(model, {"dp_shard": NPROC})
    seconds = time.perf_counter() - start
    peak = maxrss_mb()
    q = pmodel.module.model.layers[0].self_attn.q_proj.weight.to_local()
    row = {"rank": dist.get_rank(), "baseline_mb": round(baseline, 1), "peak_mb": round(peak, 1),
           "rise_mb": round(peak - baseline, 1), "seconds": round(seconds, 2),
           "q_proj_local_std": round(float(q.std()), 5)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in pmodel.module.parameters())  # this rank's shards
        with open(out, "w") as f:
            json.dump({"ranks": rows, "local_params": params}, f)
    dist.destroy_process_group()


def model_size() -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    n = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return n, largest


def launch(method: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
               os.path.abspath(__file__), "--worker", method, "--rows", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", "ULTRASCALE_DEVICE": "cpu"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{method} launch failed:\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/init_memory.json")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--worker", choices=["meta", "from_config"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.rows)

    import torch

    n_params, largest = model_size()
    full_mb = n_params * 4 / 2**20
    runs = []
    for repeat in range(args.repeats):
        for method in ("meta", "from_config"):  # alternating: machine noise hits both alike
            result = launch(method)
            runs.append({"method": method, "repeat": repeat, **result})
            worst = max(r["rise_mb"] for r in result["ranks"])
            print(f"repeat {repeat} {method:12s} worst-rank rise {worst:8.1f} MB  "
                  f"({', '.join(str(r['rise_mb']) for r in result['ranks'])})", flush=True)
    summary = {}
    for method in ("meta", "from_config"):
        mine = [r for r in runs if r["method"] == method]
        summary[method] = {
            "median_worst_rank_rise_mb": statistics.median(max(x["rise_mb"] for x in r["ranks"]) for r in mine),
            "median_rise_mb_per_rank": [statistics.median(r["ranks"][i]["rise_mb"] for r in mine)
                                        for i in range(NPROC)],
            "median_seconds_slowest_rank": statistics.median(max(x["seconds"] for x in r["ranks"]) for r in mine),
        }
    meta, old = summary["meta"], summary["from_config"]
    summary["ratio_meta_over_from_config"] = round(meta["median_worst_rank_rise_mb"]
                                                   / old["median_worst_rank_rise_mb"], 3)
    summary["meta_rise_over_full_model"] = round(meta["median_worst_rank_rise_mb"] / full_mb, 3)
    summary["from_config_rise_over_full_model"] = round(old["median_worst_rank_rise_mb"] / full_mb, 3)
    result = {
        "script": "benchmarks/init_memory.py",
        "command": " ".join(["python", *sys.argv]),
        "date": args.date,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {NPROC} CPU ranks (gloo), 1 thread/rank, "
                   f"torch {torch.__version__}",
        "model": {"config": {"model_type": "llama", **CONFIG}, "params": n_params, "fp32_mb": round(full_mb, 1),
                  "largest_module_params": largest, "largest_module_fp32_mb": round(largest * 4 / 2**20, 1),
                  "shard_fp32_mb": round(full_mb / NPROC, 1)},
        "layout": {"dp_shard": NPROC, "zero_stage": 3},
        "summary": summary,
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"model_fp32_mb": round(full_mb, 1), **summary}, indent=1))


if __name__ == "__main__":
    main()

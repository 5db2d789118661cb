"""The planner's memory per GPU for Qwen3-30B-A3B on 8 x H100 under expert parallelism, beside the peak memory
transformers publishes for the same model, GPUs and sequence length (docs/source/en/expert_parallelism.md,
"Combining with FSDP2": full fine-tuning in bf16 at sequence length 2048; EP8 38.6 GB, EP4 + FSDP2 34.2 GB,
EP2 + FSDP4 32.3 GB per GPU).

    python benchmarks/ep_memory_plan.py     # writes benchmarks/results/ep_memory_plan.json; a few seconds, CPU only

Two meshes per row, each costed as ``ultrascale plan --layout`` costs it (this package's memory profile: fp32 weights,
gradients and AdamW states, bf16 compute; one 2048-token sequence per GPU per micro-batch):

- "ep over data parallel": every GPU its own sequence, ZeRO-3 over 8, ep borrowing its ranks from dp_shard
  (dp_shard=8 with ep 8, 4 or 2: efsdp = 8/ep shards the experts further);
- "transformers' mesh": tensor parallel of degree ep for everything but the experts (transformers requires
  ep_size = tp_size), FSDP over the rest (fsdp 1, 2, 4), so the tp ranks share one sequence.

The memory is a prediction (``planner.cost.CostModel.evaluate``), not a measurement; transformers' figures are
measured peaks. Micro-batch size and recomputation of transformers' run are not stated; both recomputation settings
are given here.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ultrascale_plugins.planner.cost import CostModel, Workload, layout_from_string  # noqa: E402
from ultrascale_plugins.planner.hardware import PRESETS  # noqa: E402
from ultrascale_plugins.planner.model_spec import ModelSpec, load_model_config  # noqa: E402

SEQ = 2048
# transformers' table: configuration, tokens/s/GPU, peak memory/GPU (GB)
PUBLISHED = {
    "EP8": ("tp_size=8 (ep_size=8)", 3485, 38.6),
    "EP4 + FSDP2": ("tp_size=4, fsdp_size=2 (ep_size=4)", 2900, 34.2),
    "EP2 + FSDP4": ("tp_size=2, fsdp_size=4 (ep_size=2)", 2830, 32.3),
}
LAYOUTS = {  # row: (ep over data parallel, transformers' mesh)
    "EP8": ("dp=8,ep=8", "dp=1,tp=8,ep=8"),
    "EP4 + FSDP2": ("dp=8,ep=4", "dp=2,tp=4,ep=4"),
    "EP2 + FSDP4": ("dp=8,ep=2", "dp=4,tp=2,ep=2"),
}
SOURCE = "https://github.com/huggingface/transformers/blob/main/docs/source/en/expert_parallelism.md"


def cost_one(spec, text: str, recompute: str) -> dict:
    lay = layout_from_string(f"{text},zero=3,mbs=1,ga=1,recompute={recompute}", 8).replace(mixed_precision="bf16")
    cost = CostModel(spec, PRESETS["h100-sxm-80gb"], Workload(SEQ, lay.dp, "ultrascale", "adamw", "bf16"))
    result = cost.evaluate(lay)
    mem = {k: round(v, 2) for k, v in result.memory_gb.items()}
    states = mem["params"] + mem["grads"] + mem["optimizer"]
    return {"layout": lay.label(), "fields": lay.fields(), "memory_gb": mem,
            "model_states_gb": round(states, 2),
            # the same run with weights, gradients and AdamW moments held in bf16 (transformers' bf16 model and
            # torch's AdamW keep its states in the parameters' dtype): half of every byte of model state
            "total_if_states_bf16_gb": round(mem["total"] - states / 2, 2),
            "runnable": result.runnable, **({"not_runnable_because": result.not_runnable_because}
                                            if not result.runnable else {})}


def main() -> None:
    spec = ModelSpec.of(load_model_config("qwen3-30b-a3b"))
    rows = []
    for name, (ours, theirs) in LAYOUTS.items():
        config, tps, peak = PUBLISHED[name]
        row = {"row": name, "transformers": {"configuration": config, "tokens_per_s_per_gpu": tps,
                                             "peak_memory_gb": peak}}
        for label, text in (("ep_over_data_parallel", ours), ("transformers_mesh", theirs)):
            row[label] = {mode: cost_one(spec, text, mode) for mode in ("none", "full")}
        rows.append(row)
    report = {"model": "qwen3-30b-a3b", "params": spec.total_params, "active_params": spec.active_params,
              "gpus": 8, "hardware": dataclasses.asdict(PRESETS["h100-sxm-80gb"]), "seq_len": SEQ,
              "micro_batch_size": 1, "profile": "ultrascale", "optimizer": "adamw", "precision": "bf16",
              "source": SOURCE, "rows": rows, "command": "python benchmarks/ep_memory_plan.py",
              "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"}
    out = ROOT / "benchmarks" / "results" / "ep_memory_plan.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'row':<12} {'theirs':>6}  {'mesh':<22} {'recompute':<9} {'params':>6} {'grads':>6} {'optim':>6} "
          f"{'activ':>6} {'other':>6} {'total':>6} {'bf16 states':>11}")
    for row in rows:
        for label in ("ep_over_data_parallel", "transformers_mesh"):
            for mode, r in row[label].items():
                m = r["memory_gb"]
                print(f"{row['row']:<12} {row['transformers']['peak_memory_gb']:>6.1f}  {label:<22} {mode:<9} "
                      f"{m['params']:>6.1f} {m['grads']:>6.1f} {m['optimizer']:>6.1f} {m['activations']:>6.1f} "
                      f"{m['other']:>6.1f} {m['total']:>6.1f} {r['total_if_states_bf16_gb']:>11.1f}"
                      + ("" if r["runnable"] else f"   (not runnable here: {r['not_runnable_because']})"))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

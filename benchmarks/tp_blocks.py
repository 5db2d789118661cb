"""Which tensor-parallel blocks of every transformers causal LM reach Megatron's count: one reduction of the block's
input gradient and one of its output (forward and backward), and which ends reduce-scatter under sequence parallel.

    python benchmarks/tp_blocks.py                 # every type with a TP plan: writes results/tp_blocks.json
    python benchmarks/tp_blocks.py --types llama   # some types, printed only
    python benchmarks/tp_blocks.py --types qwen2_moe --update   # recount some types in results/tp_blocks.json

Each type is built tiny (benchmarks/compat/tiny.py, as the compatibility sweep builds it) and its plan traced once
on the meta device at tp=2 with sequence parallel, exactly as ``parallelize`` decides before sharding
(``models.dataflow.trace_tp``): no process group, no launch. A block's input is reduced once where every reader of
it leaves a partial gradient or a whole one the trace can account for, and its output once where one row-parallel
layer ends it or the trace shows it is a sum; otherwise the block reduces per projection, for the reason listed.
The compatibility sweep (benchmarks/compat_matrix.py) proves the values of the same decisions against one
process; this counts them. The script prints its own duration.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "benchmarks" / "results" / "tp_blocks.json"


def count(model_type: str) -> dict:
    import ultrascale_plugins as us
    from compat.tiny import build_model
    from ultrascale_plugins.dims.tensor.plugin import rank_local_params, simple_regions
    from ultrascale_plugins.core.engine import model_plan

    model = build_model(model_type)
    plan = model_plan(model, us.ParallelConfig(tp=2, sequence_parallel=True))
    if plan is None or not plan.regions:
        return {"state": "no plan"}
    flow = rank_local_params(model, plan)
    matched = plan.matches(model)
    output_once = simple_regions(plan, matched) | flow.sums
    input_once = set(flow.block) | flow.whole_readers  # reduced once, or not at all (whole readers only)
    both = [r for r in plan.regions if r in input_once and r in output_once]
    return {"state": "traced", "regions": len(plan.regions), "input_once": len(flow.block), "input_whole_readers": len(flow.whole_readers),
            "output_once": len(set(plan.regions) & output_once), "megatron": len(both),
            "embedding_end": ("reduce-scatter" if flow.start else "all-reduce")
            if matched.get(plan.embedding) in ("embedding_rowwise", "vocab_parallel_embedding") else "not sharded",
            "head_end": "reduce-scatter" if flow.end is not None else "all-reduce",
            "per_projection": dict(collections.Counter(flow.per_projection.values())),
            "output_per_projection": len(set(plan.regions) - output_once),
            "output_why": dict(collections.Counter(flow.sum_why.get(r, "its output is not a sum of row-parallel "
                                                                      "layers' and experts' outputs")
                                                   for r in plan.regions if r not in output_once))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*")
    parser.add_argument("--update", action="store_true", help="replace these types' rows in the results file")
    args = parser.parse_args(argv)
    from compat.tiny import Untinyable, causal_lm_types, default_config, plans

    start = time.time()
    types = args.types or sorted(t for t in causal_lm_types() if _has_tp_plan(default_config, plans, t))
    rows = {}
    for model_type in types:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows[model_type] = count(model_type)
        except Untinyable as exc:
            rows[model_type] = {"state": "not built tiny", "reason": str(exc)[:200]}
        except Exception as exc:  # noqa: BLE001 - a type the engine refuses at tp=2 (the sweep lists why)
            rows[model_type] = {"state": "refused", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        print(model_type, json.dumps(rows[model_type]), flush=True)
    seconds = round(time.time() - start, 1)
    if args.update:  # the other rows as the last full run counted them
        previous = json.loads(OUT.read_text())
        rows = {**previous["types"], **rows}
        seconds = previous["summary"]["seconds"]
    traced = [r for r in rows.values() if r["state"] == "traced"]
    summary = {"types": len(rows), "traced": len(traced),
               "all_blocks_megatron": sum(r["megatron"] == r["regions"] for r in traced),
               "blocks": sum(r["regions"] for r in traced), "megatron_blocks": sum(r["megatron"] for r in traced),
               "seconds": seconds}
    print(json.dumps(summary))
    if not args.types or args.update:
        import torch
        import transformers

        OUT.write_text(json.dumps({"date": datetime.date.today().isoformat(),
                                   "machine": f"{platform.machine()}, CPU, meta device",
                                   "torch": torch.__version__, "transformers": transformers.__version__,
                                   "summary": summary, "types": rows}, indent=1) + "\n")
    return 0


def _has_tp_plan(default_config, plans, model_type) -> bool:
    try:
        return bool(plans(default_config(model_type))[0])
    except Exception:  # noqa: BLE001 - a config that cannot be made: the sweep lists it
        return False


if __name__ == "__main__":
    sys.exit(main())

"""The compatibility matrix: every causal-LM model type of the installed transformers under every layout.

    python benchmarks/compat_matrix.py                      # the whole sweep (resumes from the cache)
    python benchmarks/compat_matrix.py --types llama qwen3  # some types
    python benchmarks/compat_matrix.py --rerun failed       # run again the cells that did not pass
    python benchmarks/compat_matrix.py --rerun all          # ignore the cache
    python benchmarks/compat_matrix.py --layouts ep2 ep4    # some layouts (the page is written only for a
                                                            # whole sweep: rerun without --layouts to write it)

The denominator is the model types whose config (or text config) carries a TP or PP plan; types without any
plan are listed apart. Each type gets a tiny config by rule (benchmarks/compat/tiny.py) and runs every layout of
``compat.layouts.MATRIX`` (the schedule cells of ``SCHEDULES`` for a few types) in one torchrun launch per world
size (benchmarks/compat/worker.py), and the expert-parallel cells of ``EP`` for the types whose experts
transformers' expert-parallel plan names: parity against one process, fp32, clipping active. A cell passes (✓)
when the loss per step, the gradient norm and the final weights match within the tolerances, or is refused (⊘)
with a ConfigError; anything else is a failure (✗: wrong result, or an error during the run). A rank that dies or
a case that runs past ``--case-timeout`` ends its launch: the case is recorded and the launch restarts with the
rest.

Results are cached in benchmarks/results/compat/<transformers version>.jsonl (one line per cell) and the table is
written to docs/compatibility.md. The script prints its own duration.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from compat.layouts import ALL, AUX, EP, LORA, MATRIX, SCHEDULE_TYPES, SCHEDULES  # noqa: E402

LOSS_TOL = 1e-5
NORM_TOL = 1e-5  # relative
WEIGHT_TOL = 1e-5


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def expert_parallel_plan(config) -> bool:
    """Whether transformers' expert-parallel plan of ``config`` (or of its text config) names experts modules
    (a ``base_model_ep_plan`` value ``ep_dispatch_experts``): the types that get the ``EP`` cells."""
    from compat.tiny import text_sub_config

    return any("ep_dispatch_experts" in (getattr(c, "base_model_ep_plan", None) or {}).values()
               for c in (config, text_sub_config(config)) if c is not None)


def classify_types(types=None) -> tuple[dict, dict, dict]:
    """(testable {type: {"tp", "pp", "moe", "ep": bool}}, untinyable {type: reason}, without plans [types])."""
    import warnings

    import transformers
    from compat.tiny import Untinyable, build_model, causal_lm_types, default_config, plans

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    testable, untiny, planless = {}, {}, {}
    for model_type in causal_lm_types():
        if types and model_type not in types:
            continue
        try:
            tp, pp = plans(default_config(model_type))
        except Untinyable as exc:
            untiny[model_type] = str(exc)
            continue
        if not tp and not pp:  # data parallel and context parallel need no plan: they get cells too
            try:
                import torch

                with torch.device("meta"):
                    build_model(model_type)
                planless[model_type] = ""
            except Exception as exc:  # noqa: BLE001
                planless[model_type] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        try:
            import torch

            with torch.device("meta"):
                build_model(model_type)
        except Untinyable as exc:
            untiny[model_type] = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001
            untiny[model_type] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        config = default_config(model_type)
        testable[model_type] = {"tp": bool(tp), "pp": bool(pp), "moe": hasattr(config, "output_router_logits"),
                                "ep": expert_parallel_plan(config)}
    return testable, untiny, planless


PLANLESS_LAYOUTS = ("dp2", "cp2_ring", "cp2_ulysses", "dp2_chunked")  # what needs no TP or PP plan


def cases_for(testable: dict, layouts=None, planless: dict | None = None) -> list[str]:
    out = [f"{model_type}:{name}" for model_type, why in (planless or {}).items() if not why
           for name in PLANLESS_LAYOUTS if not layouts or name in layouts]
    for model_type in testable:
        names = list(MATRIX) + (list(SCHEDULES) if model_type in SCHEDULE_TYPES else []) + \
            (list(AUX) if testable[model_type].get("moe") else []) + list(LORA) + \
            (list(EP) if testable[model_type].get("ep") else [])
        out += [f"{model_type}:{name}" for name in names if not layouts or name in layouts]
    return out


def load_cache(path: Path) -> dict:
    cells = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                cells[r["case"]] = r
    return cells


def verdict(r: dict) -> str:
    """'pass', 'refused', 'fail', 'untinyable'."""
    state = r.get("state")
    if state == "ran":
        ok = (r["loss_diff"] <= LOSS_TOL and r["norm_rel_diff"] <= NORM_TOL and r["weight_diff"] <= WEIGHT_TOL
              and not r.get("missing_keys") and r.get("clipped", False) and r.get("routing_match", True))
        return "pass" if ok else "fail"
    if state == "refused":
        return "refused"
    if state == "untinyable":
        return "untinyable"
    return "fail"


def run_launch(world: int, cases: list[str], out: Path, case_timeout: float, log) -> None:
    """Run ``cases`` in launches of ``world`` processes until each has a line in ``out``."""
    todo = list(cases)
    while todo:
        done_before = set(load_cache(out))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               "--max_restarts", "0", str(ROOT / "benchmarks/compat/worker.py"), str(out), *todo]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", "PYTHONFAULTHANDLER": "1",
               "COMPAT_COLLECTIVE_TIMEOUT_S": str(int(case_timeout / 3))}
        err_path = out.with_suffix(f".w{world}.stderr")
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
            current, started = None, time.time()
            while proc.poll() is None:
                time.sleep(0.5)
                running = _current_case(err_path)
                if running != current:
                    current, started = running, time.time()
                elif current and time.time() - started > case_timeout:
                    proc.kill()
                    proc.wait()
                    _record(out, current, "error", f"timeout: ran past {case_timeout:.0f} s")
                    break
        finished = set(load_cache(out))
        if proc.returncode not in (0, None) or set(todo) - finished:
            current = _current_case(err_path)
            if current and current not in finished:
                _record(out, current, "error", "a rank died: " + _tail(err_path))
        finished = set(load_cache(out))
        new = [c for c in todo if c not in finished]
        log(f"  world {world}: {len(set(todo) & (finished - done_before))} cells done, {len(new)} left")
        if len(new) == len(todo):  # no progress at all: record the rest instead of looping
            for c in new:
                _record(out, c, "error", "launch failed before the case: " + _tail(err_path))
            new = []
        todo = new


def _current_case(err_path: Path) -> str | None:
    try:
        lines = [line for line in err_path.read_text(errors="replace").splitlines()
                 if line.startswith("[compat] start ")]
    except FileNotFoundError:
        return None
    return lines[-1].split("[compat] start ", 1)[1].strip() if lines else None


def _tail(err_path: Path) -> str:
    text = err_path.read_text(errors="replace")
    own = [line.split("] ", 1)[1] for line in text.splitlines() if line.startswith("[compat] error on rank")]
    if own:  # the rank that failed first; the others only time out waiting for it
        first = [line for line in own if "Timed out" not in line and "timeout" not in line.lower()]
        return (first or own)[0][:300]
    keep = [line for line in text.splitlines() if any(k in line for k in ("Error", "error", "Signal", "Fatal"))]
    return (keep[-1] if keep else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def _record(out: Path, case: str, state: str, reason: str) -> None:
    model_type, layout = case.split(":")
    with open(out, "a") as f:
        f.write(json.dumps({"case": case, "model_type": model_type, "layout": layout, "state": state,
                            "reason": reason}) + "\n")


SYMBOL = {"pass": "✓", "refused": "⊘", "fail": "✗", "untinyable": "–"}


def write_markdown(path: Path, testable, untiny, planless, cells, vers, duration_s) -> dict:
    """The matrix as Markdown; returns the summary counts."""
    # a type whose tiny model fails in one process has no reference to compare with: list it with the types
    # that cannot be built tiny, whatever its parallel cells did
    testable, untiny = dict(testable), dict(untiny)
    for key, r in sorted(cells.items()):
        model_type = key.split(":")[0]
        if model_type in testable and r.get("state") == "untinyable":
            del testable[model_type]
            untiny[model_type] = r.get("reason", "")
    matrix_layouts = list(MATRIX)
    rows, reasons = [], []
    full_pass, tp_fsdp_pass = 0, 0
    tp_fsdp = [n for n in matrix_layouts if "pp" not in n and "cp" not in n and "chunked" not in n
               and "offload" not in n]
    chunked = [n for n in matrix_layouts if "chunked" in n]
    chunked_pass = chunked_refused = 0
    offload = [n for n in matrix_layouts if "offload" in n]
    offload_pass = 0
    cp_layouts = [n for n in matrix_layouts if n.startswith("cp") and "tp" not in n]
    cp_pass = cp_refused = cp_tp_pass = 0
    for model_type in sorted(testable):
        marks = []
        for layout in matrix_layouts:
            r = cells.get(f"{model_type}:{layout}")
            v = verdict(r) if r else "missing"
            marks.append(SYMBOL.get(v, "?"))
            if v in ("refused", "fail", "untinyable"):
                reasons.append((model_type, layout, v, r.get("reason") or _diff_text(r)))
        v_all = [verdict(cells[f"{model_type}:{n}"]) if f"{model_type}:{n}" in cells else "missing"
                 for n in matrix_layouts]
        if all(v in ("pass", "refused") for v in v_all):
            full_pass += 1
        if all(verdict(cells.get(f"{model_type}:{n}", {})) == "pass" for n in tp_fsdp):
            tp_fsdp_pass += 1
        cp_verdicts = {verdict(cells.get(f"{model_type}:{n}", {})) for n in cp_layouts}
        cp_pass += cp_verdicts == {"pass"}
        cp_refused += cp_verdicts == {"refused"}
        cp_tp_pass += all(verdict(cells.get(f"{model_type}:{n}", {})) == "pass"
                          for n in matrix_layouts if n.startswith("cp") and "tp" in n)
        chunked_verdicts = {verdict(cells.get(f"{model_type}:{n}", {})) for n in chunked}
        chunked_pass += chunked_verdicts <= {"pass", "refused"} and "pass" in chunked_verdicts
        chunked_refused += chunked_verdicts == {"refused"}
        offload_pass += all(verdict(cells.get(f"{model_type}:{n}", {})) == "pass" for n in offload)
        plans_ = "+".join(k.upper() for k in ("tp", "pp") if testable[model_type][k])
        rows.append(f"| `{model_type}` | {plans_} | " + " | ".join(marks) + " |")
    sched_rows = []
    for model_type in SCHEDULE_TYPES:
        if model_type not in testable:
            continue
        for name in SCHEDULES:
            r = cells.get(f"{model_type}:{name}")
            v = verdict(r) if r else "missing"
            sched_rows.append((model_type, name, SYMBOL.get(v, "?"), "" if v == "pass" else
                               (r or {}).get("reason") or _diff_text(r or {})))
    aux_rows = []
    for model_type in sorted(t for t, v in testable.items() if v.get("moe")):
        marks = []
        for name in AUX:
            r = cells.get(f"{model_type}:{name}")
            v = verdict(r) if r else "missing"
            marks.append(SYMBOL.get(v, "?"))
            if v in ("refused", "fail", "untinyable"):
                reasons.append((model_type, name, v, r.get("reason") or _diff_text(r)))
        aux_rows.append(f"| `{model_type}` | " + " | ".join(marks) + " |")
    lora_rows, lora_pass, lora_each = [], 0, collections.Counter()
    for model_type in sorted(testable):
        found = {name: cells.get(f"{model_type}:{name}") for name in LORA}
        verdicts = {name: verdict(r) if r else "missing" for name, r in found.items()}
        lora_pass += all(v in ("pass", "refused") for v in verdicts.values())
        lora_each.update(name for name, v in verdicts.items() if v == "pass")
        why = "; ".join(f"{n}: {_md(r.get('reason') or _diff_text(r))[:200]}" for n, r in found.items()
                        if r and verdicts[n] != "pass")
        lora_rows.append(f"| `{model_type}` | " + " | ".join(SYMBOL.get(v, "?") for v in verdicts.values())
                         + f" | {why} |")
    ep_types = sorted(t for t, v in testable.items() if v.get("ep"))
    ep_rows, ep_all, ep_full, ep_each = [], 0, 0, {v: collections.Counter() for v in ("pass", "refused", "fail")}
    for model_type in ep_types:
        found = {name: cells.get(f"{model_type}:{name}") for name in EP}
        verdicts = {name: verdict(r) if r else "missing" for name, r in found.items()}
        ep_all += all(v in ("pass", "refused") for v in verdicts.values())
        ep_full += all(v == "pass" for v in verdicts.values())
        for name, v in verdicts.items():
            if v != "missing":
                ep_each[v if v in ("pass", "refused") else "fail"][name] += 1
        same = {}  # reason -> the columns that give it (a refusal often holds for every column)
        for n, r in found.items():
            if r and verdicts[n] != "pass":
                same.setdefault(_md(r.get("reason") or _diff_text(r))[:200], []).append(n)
        why = "; ".join(f"{', '.join(names)}: {text}" for text, names in same.items())
        ep_rows.append(f"| `{model_type}` | " + " | ".join(SYMBOL.get(v, "?") for v in verdicts.values())
                       + f" | {why} |")
    planless_rows, planless_cp_pass = [], 0
    for model_type in sorted(m for m, why in planless.items() if not why):
        found = [cells.get(f"{model_type}:{n}") for n in PLANLESS_LAYOUTS]
        if any(r and verdict(r) == "untinyable" for r in found):
            planless_rows.append(f"| `{model_type}` | " + " | ".join("–" for _ in found) + " | the tiny model fails "
                                 "in one process |")
            continue
        marks = [SYMBOL.get(verdict(r), "?") if r else "?" for r in found]
        why = "; ".join(f"{n}: {_md(r.get('reason') or _diff_text(r))[:160]}" for n, r in zip(PLANLESS_LAYOUTS, found)
                        if r and verdict(r) != "pass")
        planless_cp_pass += all(r and verdict(r) == "pass" for n, r in zip(PLANLESS_LAYOUTS, found)
                                if n.startswith("cp"))
        planless_rows.append(f"| `{model_type}` | " + " | ".join(marks) + f" | {why} |")
    counts = collections.Counter(verdict(r) for r in cells.values())
    summary = {"denominator": len(testable) + len(untiny), "testable": len(testable), "untinyable": len(untiny),
               "chunked_pass": chunked_pass, "chunked_refused": chunked_refused,
               "planless": len(planless), "all_layouts": full_pass, "tp_fsdp_all_pass": tp_fsdp_pass,
               "cp_all_pass": cp_pass, "cp_refused": cp_refused, "cp_tp_pass": cp_tp_pass, "lora_all": lora_pass,
               "ep_types": len(ep_types), "ep_all": ep_all, "ep_all_pass": ep_full,
               "ep_each": {v: dict(c) for v, c in ep_each.items()}, "cells": dict(counts)}
    lines = [
        "# Compatibility matrix",
        "",
        f"Generated by `python benchmarks/compat_matrix.py` on {datetime.date.today().isoformat()} with "
        f"transformers {vers['transformers']} and torch {vers['torch']} ({platform.machine()}, "
        f"{os.cpu_count()} cores, CPU, gloo); the sweep took {duration_s / 60:.1f} min of cell time.",
        "",
        "Every model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` whose config (or text config) carries a "
        "tensor-parallel or pipeline plan, built tiny by rule (hidden 64, 4 layers, 8 heads / 4 KV heads, 4 "
        "experts, vocabulary 256), trained 4 SGD steps on padded batches with global gradient-norm clipping at "
        "0.05 (active at every step) under each layout, and compared with one process running the plain "
        f"transformers model: loss per step within {LOSS_TOL:g}, gradient norm within {NORM_TOL:g} (relative), "
        f"final weights within {WEIGHT_TOL:g} (relative to the tensor's largest entry where that exceeds 1), fp32.",
        "",
        f"**{summary['all_layouts']} of {summary['testable']} model types that build tiny pass every layout "
        f"(✓) or are refused before any worker starts (⊘)**; {summary['tp_fsdp_all_pass']} of "
        f"{summary['testable']} ({100 * tp_fsdp_pass / max(1, summary['testable']):.0f} %) pass every TP/FSDP "
        f"layout (dp2, tp2, tp2_sp, dp2_tp2_sp). {summary['untinyable']} more types with a plan cannot be built "
        f"tiny (listed below with the reason), so of all {summary['denominator']} types with a plan "
        f"{100 * tp_fsdp_pass / max(1, summary['denominator']):.0f} % are shown to pass every TP/FSDP layout; "
        f"{summary['planless']} causal-LM types carry no TP or PP plan (their data- and context-parallel cells are "
        f"at the end). Context parallel: {cp_pass} of {summary['testable']} types pass the ring and Ulysses at "
        f"cp=2, {cp_refused} are refused before any worker starts (attention outside transformers' attention "
        "interface, convolutions or state-space layers over the sequence, a model-built mask or sparse-attention "
        f"indexer); {cp_tp_pass} pass Ulysses composed with TP + SP (`cp2_tp2_sp`); the router auxiliary loss "
        f"under cp is in the MoE table. The chunked loss ({', '.join(f'`{n}`' for n in chunked)}): {chunked_pass} "
        f"types pass it (in each of those layouts their plans allow), {chunked_refused} are refused before any worker "
        "starts (a model that changes its logits after the head, or whose head is not a plain Linear). Offload "
        f"({', '.join(f'`{n}`' for n in offload)}: ZeRO-3 with the states in host memory, with what the layers "
        f"save for their backward there): {offload_pass} types pass both. Expert "
        f"parallelism: {ep_all} of the {len(ep_types)} types whose experts "
        "transformers' expert-parallel plan names pass every expert-parallel layout or are refused before any "
        f"worker starts, {ep_full} pass all {len(EP)} (" + ", ".join(f"`{n}`" for n in EP) + "; the expert-parallel "
        "table).",
        "",
        "✓ parity · ⊘ refused with a ConfigError before training (reason below) · ✗ failure (reason below) · "
        "– the tiny model does not run in one process",
        "",
        "| model type | plans | " + " | ".join(matrix_layouts) + " |",
        "| --- | --- | " + " | ".join("---" for _ in matrix_layouts) + " |",
        *rows,
        "",
        "Layouts: " + "; ".join(f"`{n}` = {w} processes, {_fields(l)}" for n, (w, l) in MATRIX.items()) + ".",
        "",
        "## Pipeline schedules × TP, TP + SP, ZeRO-3 (representative types)",
        "",
        "| model type | layout | result | reason |",
        "| --- | --- | --- | --- |",
        *[f"| `{m}` | {n} | {s} | {why} |" for m, n, s, why in sched_rows],
        "",
        "## Mixture of experts with the router auxiliary loss (`output_router_logits=True`)",
        "",
        "The load-balancing loss takes means over every token of the global batch; each data-parallel rank gathers "
        "the router logits of the whole batch and the model's own `load_balancing_loss_func` gives the value, so "
        "loss and gradients equal one process's. Routing (the experts of every token) is compared token by token "
        "in every non-pipeline MoE cell.",
        "",
        "| model type | " + " | ".join(AUX) + " |",
        "| --- | " + " | ".join("---" for _ in AUX) + " |",
        *aux_rows,
        "",
        "## LoRA adapters (PEFT)",
        "",
        "The same tiny models wrapped by `peft.get_peft_model` with LoRA (rank 4, alpha 8, no dropout) on every "
        "`nn.Linear` inside the decoder layers, by name (for some mixture-of-experts types PEFT then also adapts "
        "the fused expert and router weights of that name, which tensor parallel refuses), compared with the same "
        "PEFT model in one process: loss, gradient norm of the adapters and final weights (adapters trained, base "
        "unchanged) within the tolerances above. "
        f"{lora_pass} of {summary['testable']} types pass both or are refused before any worker starts; "
        + ", ".join(f"{lora_each[n]} pass `{n}`" for n in LORA) + ". "
        "Their clipping threshold is 1e-4 (LoRA's B starts at zero: the adapters' first gradients are small). "
        + "; ".join(f"`{n}` = {w} processes, {_fields({k: v for k, v in l.items() if k not in ('peft', 'clip')})}"
                    for n, (w, l) in LORA.items()) + ".",
        "",
        "| model type | " + " | ".join(LORA) + " | reason a cell is not ✓ |",
        "| --- | " + " | ".join("---" for _ in LORA) + " | --- |",
        *lora_rows,
        "",
        "## Expert parallelism (`ep`)",
        "",
        f"The {len(ep_types)} types above whose experts transformers' expert-parallel plan names (a "
        "`base_model_ep_plan` entry `ep_dispatch_experts`). With `ep` = N each process holds 1/N of every "
        "mixture-of-experts layer's experts, and every token is sent to the processes that hold the experts its "
        "router picked, and back; the router itself runs unchanged on every token. The `ep` processes are borrowed "
        "from data, context and tensor parallelism (`ep` divides dp_shard × cp × tp, so no process is added), and "
        "what is left, efsdp = dp_shard × cp × tp / ep, shards the experts further with ZeRO-3; the experts are not "
        "split by tensor parallelism. Columns: `ep2` = dp_shard=2, ep=2 (2 processes); `ep2_dp2` = dp_shard=4, "
        "ep=2, so the experts are also sharded by ZeRO-3 over efsdp=2 (4 processes); `ep2_tp2_sp` = dp_shard=2, "
        "tp=2 with sequence parallel, ep=2 (4 processes); `pp2_ep2` = pp=2, dp_shard=2, ep=2 (4 processes); "
        "`ep4` = dp_shard=4, ep=4 (4 processes). Each cell is parity against one process running the plain "
        "transformers model (loss per step, global gradient norm with clipping active, final weights within "
        f"{WEIGHT_TOL:g}, and the experts of every token compared token by token, except under the pipeline, where "
        "the routers run per micro-batch on other ranks) or a refusal with a ConfigError before training starts. "
        + "Per column, passing / refused / failing types: "
        + "; ".join(f"`{n}` {ep_each['pass'][n]} / {ep_each['refused'][n]} / {ep_each['fail'][n]}" for n in EP)
        + ".",
        "",
        "| model type | " + " | ".join(EP) + " | reason a cell is not ✓ |",
        "| --- | " + " | ".join("---" for _ in EP) + " | --- |",
        *ep_rows,
        "",
        "## Why a cell is not ✓",
        "",
        "| model type | layout | result | reason |",
        "| --- | --- | --- | --- |",
        *[f"| `{m}` | {lay} | {SYMBOL[v]} | {_md(why)} |" for m, lay, v, why in reasons],
        "",
        "## Types with a plan that cannot be built tiny",
        "",
        "| model type | reason |",
        "| --- | --- |",
        *[f"| `{m}` | {_md(why)} |" for m, why in sorted(untiny.items())],
        "",
        "## Causal-LM types without a TP or PP plan",
        "",
        "These train under data parallel (ZeRO, DDP) and context parallel, which need no plan; `tp > 1` and "
        "`pp > 1` are refused for them before any worker starts. GPT-2 has tensor parallel through the built-in "
        "plugin `ultrascale_plugins.models.gpt2`. Same tiny models, batches and tolerances as above.",
        "",
        "| model type | " + " | ".join(PLANLESS_LAYOUTS) + " | reason a cell is not ✓ |",
        "| --- | " + " | ".join("---" for _ in PLANLESS_LAYOUTS) + " | --- |",
        *planless_rows,
        "",
        f"Of the {len(planless_rows)} that build tiny, {planless_cp_pass} pass the ring and Ulysses. "
        + (("Not built tiny: " + "; ".join(f"`{m}` ({_md(why)})" for m, why in sorted(planless.items()) if why)
            + ".") if any(planless.values()) else ""),
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return summary


def _fields(layout: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in layout.items())


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:400]


def _diff_text(r: dict) -> str:
    if r.get("state") != "ran":
        return ""
    return (f"wrong result: loss diff {r['loss_diff']:.1e}, norm rel diff {r['norm_rel_diff']:.1e}, "
            f"weight diff {r['weight_diff']:.1e}" + ("" if r.get("clipped", True) else ", clipping not active")
            + ("" if r.get("routing_match", True) else ", routing differs"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="only these model types")
    parser.add_argument("--layouts", nargs="*", help="only these layouts")
    parser.add_argument("--rerun", choices=("none", "failed", "all"), default="none")
    parser.add_argument("--case-timeout", type=float, default=90.0)
    parser.add_argument("--cache", type=Path, help="results file (default: benchmarks/results/compat/<tf>.jsonl)")
    parser.add_argument("--markdown", type=Path, default=ROOT / "docs/compatibility.md")
    parser.add_argument("--no-markdown", action="store_true")
    args = parser.parse_args(argv)

    start = time.time()
    vers = versions()
    cache = args.cache or ROOT / f"benchmarks/results/compat/transformers-{vers['transformers']}.jsonl"
    cache.parent.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    testable, untiny, planless = classify_types(args.types)
    log(f"{len(testable)} testable types, {len(untiny)} with a plan that cannot be built tiny, "
        f"{len(planless)} without a plan ({time.time() - start:.0f} s)")
    cells = load_cache(cache)
    wanted = cases_for(testable, args.layouts, planless)
    if args.rerun == "all":
        drop = set(wanted)
    elif args.rerun == "failed":
        drop = {c for c in wanted if c in cells and verdict(cells[c]) == "fail"}
    else:
        drop = set()
    if drop:
        kept = [json.dumps(r) for c, r in cells.items() if c not in drop]
        cache.write_text("".join(line + "\n" for line in kept))
        cells = load_cache(cache)
    todo = [c for c in wanted if c not in cells]
    by_world = collections.defaultdict(list)
    for case in todo:
        by_world[ALL[case.split(":")[1]][0]].append(case)
    for world, cases in sorted(by_world.items()):
        log(f"world {world}: {len(cases)} cells")
        run_launch(world, cases, cache, args.case_timeout, log)
    cells = load_cache(cache)
    duration = time.time() - start
    cell_time = sum(float(r.get("seconds", 0.0)) for r in cells.values())
    counts = collections.Counter(verdict(cells[c]) for c in wanted if c in cells)
    log(f"cells: {dict(counts)}")
    for c in wanted:
        if c in cells and verdict(cells[c]) == "fail":
            r = cells[c]
            log(f"  ✗ {c}: {r.get('reason') or _diff_text(r)} {r.get('where', '')}")
    if not args.no_markdown and not args.types and not args.layouts:
        summary = write_markdown(args.markdown, testable, untiny, planless, cells, vers, cell_time)
        log(json.dumps(summary))
    log(f"sweep took {duration:.0f} s ({duration / 60:.1f} min) on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())

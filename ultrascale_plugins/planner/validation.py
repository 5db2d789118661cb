"""The cost model against published measurements: the Ultra-Scale Playbook's 1,649 runs of a 1B and a 3B
Llama-style model on 1-64 nodes of 8 H100 (``ultrascale_plugins/resources/playbook_benchmarks_1B_3B.csv``, from the
public charts of ``nanotron/ultrascale-playbook``; its setup is in docs/planner.md).

Four figures, each with the target the project set (issue 13):
- memory: absolute relative error of the predicted peak on completed runs (median <= 10 %, 90th pct <= 25 %);
- out of memory: runs predicted not to complete vs runs that did not (the file's ``crashed_or_oom``; accuracy
  >= 90 %). Predicted not to complete: over 80 GB, or more pipeline stages than the model has layers (93 of the
  522 failed runs, which no engine can build); the accuracy from memory alone is reported beside it;
- ranking: Spearman correlation of predicted vs measured tokens/s/GPU inside each (model, nodes) cell (median
  >= 0.7);
- choice: the cell's measured best layout among the planner's top 5 of that cell's completed layouts, ranked as
  ``ultrascale plan`` ranks (with the headroom rule, ``headroom.prefer_headroom``; >= 70 % of cells).

And what the headroom rule does to each cell's first choice among all its runs (``headroom_choice``): the cells
where it changes, whether the choices completed, and their measured throughput against the speed-only choice's.

Everything is predicted with the "nanotron" profile (bf16 weights, fp32 gradient accumulation and master weights,
Adam) on the ``h100-sxm-80gb`` preset, with the global constants of ``constants.CONSTANTS``: nothing is fitted per row.

What ran and what was recorded, from nanotron's code (``scripts/scaling_benchmarks.py``, "used in" the Playbook, and
its trainer, commit e24d2483, February 2025):
- the models: Llama blocks with as many key/value heads as query heads (the script sets no GQA: "we can't bench
  tp>8 if we use 8 KV heads"), a 131,072-token vocabulary, tied embeddings below an FFN of 10,000; the 3B has 32
  heads ("24heads -> 32heads"). ``MODELS`` holds the script's sizes, 8B to 405B included;
- the memory column is ``torch.cuda.max_memory_reserved()`` in GiB (1024³ bytes), written by global rank 0 only,
  which nanotron places at pipeline stage 0, data-parallel rank 0, tensor-parallel rank 0 (its rank matrix is
  (pp, dp, tp), tp innermost). The peak *allocated* figure it logs beside it is reset after the forward/backward
  passes, so it cannot be the column: that grows with the micro-batch. So the error is that of the first pipeline
  stage's prediction (with the allocator's slack), converted to GiB; whether a run fits is judged on the most
  loaded rank, since any rank running out of memory ends the run.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import statistics
from pathlib import Path

from .cost import GB, CostModel, Layout, Workload, coordinates_to_cost, peak_memory_gb
from .hardware import PRESETS
from .headroom import MEMORY_MARGIN, prefer_headroom
from .model_spec import ModelSpec, load_model_config

DATA = Path(__file__).resolve().parent.parent / "resources" / "playbook_benchmarks_1B_3B.csv"
GIB = 2**30


def _playbook_llama(layers: int, hidden: int, heads: int, ffn: int) -> dict:
    """A model of the Playbook's benchmark script: Llama blocks, key/value heads = heads, vocabulary 131,072,
    embeddings tied below an FFN width of 10,000."""
    return dict(model_type="llama", vocab_size=131072, hidden_size=hidden, intermediate_size=ffn,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, hidden_act="silu",
                rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=ffn < 10_000)


# the sizes of nanotron's scripts/scaling_benchmarks.py (layers, hidden, heads, FFN)
MODELS = {"1B": _playbook_llama(16, 2048, 32, 8192), "3B": _playbook_llama(28, 3072, 32, 8192),
          "8B": _playbook_llama(32, 4096, 32, 14336), "70B": _playbook_llama(80, 8192, 64, 28672),
          "405B": _playbook_llama(126, 16384, 128, 53248)}
TARGETS = {"memory_median_error": 0.10, "memory_p90_error": 0.25, "oom_accuracy": 0.90,
           "spearman_median": 0.70, "top5_hit_rate": 0.70}


def load_rows(path: Path = DATA) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def row_layout(row: dict) -> Layout:
    return Layout(dp_shard=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]), zero_stage=int(row["zero"]),
                  micro_batch_size=int(row["mbs"]), grad_accum=int(row["grad_acc"]), pp_schedule="1f1b",
                  mixed_precision="bf16", sequence_parallel=int(row["tp"]) > 1)


class _Models(dict):
    """A cost model per (model, global batch): 17 rows' dp x mbs x grad_acc is not their ``gbs`` column; the
    layout is what ran, so its product is taken as their global batch."""

    def __init__(self, constants):
        super().__init__()
        self.constants = constants
        self.specs = {}

    def spec(self, model: str) -> ModelSpec:
        if model not in self.specs:
            self.specs[model] = ModelSpec.of(load_model_config(MODELS[model]))
        return self.specs[model]

    def for_row(self, row) -> CostModel:
        gbs = int(row["dp"]) * int(row["mbs"]) * int(row["grad_acc"])
        key = (row["model"], gbs)
        if key not in self:
            self[key] = CostModel(self.spec(row["model"]), PRESETS["h100-sxm-80gb"],
                                  Workload(4096, gbs, "nanotron", "adamw"), self.constants)
        return self[key]


def recorded_rank_gb(model: CostModel, layout: Layout) -> float:
    """Predicted peak (GB, with the allocator's slack) of the rank whose memory the Playbook recorded: global rank
    0, nanotron's first pipeline stage."""
    ests = model.estimates(layout)
    coords = coordinates_to_cost(layout.config(), model.pm)
    first = [e for e, c in zip(ests, coords) if c.get("pp", 0) == 0]
    return peak_memory_gb(first, model.c)["total"]


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0


def percentile(values, q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def planner_order(results: list, memory_gb: float) -> list:
    """``results`` ranked as ``ultrascale plan`` ranks them: those that fit first, by predicted tokens/s/GPU, then
    the headroom rule. Every measured layout counts as runnable: it ran (under nanotron)."""
    ranked = sorted(results, key=lambda r: (not r.fits, -r.tokens_per_s_per_gpu))
    return prefer_headroom([dataclasses.replace(r, runnable=True) for r in ranked], memory_gb)


def headroom_choice(runs: dict, memory_gb: float) -> dict:
    """{cell: the first choice by speed alone and with the headroom rule, among every buildable run of the cell}:
    for each, how many runs of that layout the file has and how many completed (19 layouts ran twice, once to the
    end and once out of memory), their largest memory (GiB reserved) and mean tokens/s/GPU."""
    out = {}
    for key, cell in sorted(runs.items()):
        measured = collections.defaultdict(list)
        for r, row in cell:
            measured[r.layout].append(row)
        by_speed = sorted((r for r, _ in cell), key=lambda r: (not r.fits, -r.tokens_per_s_per_gpu))
        pick = {"speed": by_speed[0], "headroom": planner_order([r for r, _ in cell], memory_gb)[0]}
        out[f"{key[0]}/{key[1]} nodes"] = {name: _measured_choice(r, measured[r.layout]) for name, r in pick.items()}
    return out


def _measured_choice(result, rows: list[dict]) -> dict:
    done = [row for row in rows if row["status"] == "ok"]
    return {"layout": result.layout.label(), "predicted_gb": round(result.memory_gb["total"], 1), "runs": len(rows),
            "completed": len(done), "measured_gib": max((float(row["mem_gb"]) for row in done), default=None),
            "measured_tok_s_gpu": statistics.fmean(float(row["tok_s_gpu"]) for row in done) if done else None}


def validate(rows: list[dict] | None = None, constants: dict | None = None, memory_gb: float = 80.0) -> dict:
    """The four figures over ``rows`` (default: the whole file), with per-cell details, and what the headroom rule
    changes in each cell's first choice."""
    rows = load_rows() if rows is None else rows
    models = _Models(constants)
    mem_errors, oom_hits, memory_only_hits, oom_total = [], 0, 0, 0
    cells = collections.defaultdict(list)
    buildable = collections.defaultdict(list)
    for row in rows:
        model, layout = models.for_row(row), row_layout(row)
        result = model.evaluate(layout)
        predicted = result.memory_gb["total"]  # the most loaded rank, GB
        crashed = row["status"] != "ok"
        unbuildable = int(row["pp"]) > models.spec(row["model"]).config.num_hidden_layers
        oom_total += 1
        oom_hits += (predicted > memory_gb or unbuildable) == crashed
        memory_only_hits += (predicted > memory_gb) == crashed
        if not unbuildable:
            buildable[(row["model"], int(row["nodes"]))].append((result, row))
        if not crashed:
            measured = float(row["mem_gb"]) * GIB  # bytes
            mem_errors.append(abs(recorded_rank_gb(model, layout) * GB - measured) / measured)
            cells[(row["model"], int(row["nodes"]))].append((result, float(row["tok_s_gpu"])))
    per_cell, rhos, hits = {}, [], 0
    for key in sorted(cells):
        runs = cells[key]
        rho = spearman([r.tokens_per_s_per_gpu for r, _ in runs], [m for _, m in runs])
        best = max(range(len(runs)), key=lambda i: runs[i][1])
        # the planner's ranking of the completed layouts (planner_order), as positions in ``runs``
        position = {(r.layout, r.tokens_per_s_per_gpu): i for i, (r, _) in enumerate(runs)}
        order = [position[(r.layout, r.tokens_per_s_per_gpu)] for r in planner_order([r for r, _ in runs], memory_gb)]
        hit = best in order[:5]
        rhos.append(rho)
        hits += hit
        per_cell[f"{key[0]}/{key[1]} nodes"] = {"runs": len(runs), "spearman": round(rho, 3), "best_in_top5": hit,
                                                "best_rank": order.index(best) + 1}
    figures = {
        "memory_median_error": statistics.median(mem_errors),
        "memory_p90_error": percentile(mem_errors, 0.9),
        "oom_accuracy": oom_hits / oom_total,
        "oom_accuracy_memory_only": memory_only_hits / oom_total,
        "spearman_median": statistics.median(rhos),
        "top5_hit_rate": hits / len(cells),
    }
    met = {k: (figures[k] <= TARGETS[k] if k.startswith("memory") else figures[k] >= TARGETS[k]) for k in TARGETS}
    return {"rows": len(rows), "completed": len(mem_errors), "cells": len(cells), "figures": figures,
            "targets": TARGETS, "met": met, "per_cell": per_cell,
            "headroom": {"memory_margin": MEMORY_MARGIN, "first_choice": headroom_choice(buildable, memory_gb)}}

"""What ``ultrascale plan`` prints: the ranked table, and for the chosen layout the ready-to-paste Lightning
strategy call, Accelerate config and ``ultrascale train`` recipe."""
from __future__ import annotations

import json
import math

import yaml

from .cost import Result
from .headroom import MEMORY_MARGIN, edge_risk, explain, faster_at_the_edge, free_fraction, has_headroom, status

_SHORT = {"compute": "compute", "bubble": "pipeline bubble", "host": "host link and host optimizer"}


def dominant_name(key: str) -> str:
    return _SHORT.get(key, key.replace("comm_", "communication on ") if key.startswith("comm_") else key)


def table(results: list[Result], memory_gb: float, top: int, margin: float = MEMORY_MARGIN) -> str:
    """The ranked rows: whether each fits with room for the memory estimate's error ('yes'), only as predicted
    ('edge') or not ('NO'), the share of memory it leaves free, and a note where a row's figures are another's."""
    width = max([74] + [len(r.layout.label()) for r in results[:top]])
    head = (f"{'#':>3}  {'layout':<{width}} {'fits':<4} {'GB/GPU':>7} {'free':>6} {'tok/s/GPU':>10} {'MFU':>6}  "
            "dominant cost")
    lines = [head, "-" * len(head)]
    notes = twin_notes(results, top)
    for i, r in enumerate(results[:top], 1):
        mark = "" if r.runnable else "  (not runnable here)"
        note = f"; {notes[i - 1]}" if i - 1 in notes else ""
        lines.append(f"{i:>3}  {r.layout.label():<{width}} {status(r, memory_gb, margin):<4} "
                     f"{r.memory_gb['total']:>7.1f} {free_fraction(r, memory_gb):>6.1%} "
                     f"{r.tokens_per_s_per_gpu:>10,.0f} {r.mfu:>6.1%}  {dominant_name(r.dominant)}{note}{mark}")
    lines.append(f"(memory limit {memory_gb:g} GB per GPU; {len(results)} layouts costed)\n "
                 + explain(margin, memory_gb))
    if any(PIPELINE_ZERO3 in n for n in notes.values()):
        lines.append(" 'ZeRO-3 runs as ZeRO-2 in a pipeline': inside a pipeline this engine keeps each stage's "
                     "weights gathered between micro-batches (one all-gather per step, as torchtitan does), so ZeRO-3 "
                     "holds and moves what ZeRO-2 does")
    return "\n".join(lines)


PIPELINE_ZERO3 = "ZeRO-3 runs as ZeRO-2 in a pipeline"


def twin_notes(results: list[Result], top: int) -> dict[int, str]:
    """{row index: note} for the first ``top`` rows whose layout differs from another costed one only in a higher
    ZeRO stage and whose memory and time are the same: inside a pipeline the engine keeps each stage's weights
    gathered between micro-batches (``dims/data_parallel/plugin.py``), so ZeRO-3 runs as ZeRO-2 does."""
    rows = {}
    for i, r in enumerate(results):
        key = (r.layout.replace(zero_stage=0).label(), round(r.memory_gb["total"], 6), round(r.step_s, 9))
        rows.setdefault(key, []).append(i)
    notes = {}
    for twins in rows.values():
        for i in twins:
            lower = [j for j in twins if results[j].layout.zero_stage < results[i].layout.zero_stage]
            if i >= top or not lower:
                continue
            j = min(lower, key=lambda k: results[k].layout.zero_stage)
            other = results[j].layout.zero_stage
            where = f"#{j + 1}" if j < top else f"zero={other}, not shown"
            pipeline = results[i].layout.pp > 1 and (other, results[i].layout.zero_stage) == (2, 3)
            notes[i] = f"same as {where}: " + (PIPELINE_ZERO3 if pipeline else f"the same figures as zero={other}")
    return notes


def headroom_line(best: Result, results: list[Result], memory_gb: float, margin: float = MEMORY_MARGIN,
                  elsewhere=None, savers: frozenset = frozenset()) -> str:
    """What the chosen layout leaves free: with the margin, the fastest layout at the edge it was chosen over and
    that one's risk; at the edge, that no costed layout leaves the margin and where one does (``elsewhere``, a
    ``search.RoomElsewhere``; None: the layout was given, not searched). ``savers``: the memory savers' fields."""
    left = memory_gb - best.memory_gb["total"]
    free = f"{free_fraction(best, memory_gb):.1%} of the GPU's memory free ({left:.1f} GB)"
    if margin <= 0:
        return f"{free}; ranked by speed alone (--memory-margin 0)"
    if not has_headroom(best, memory_gb, margin):
        return (f"at the edge: {free}, less than the memory estimate's {margin:.1%} margin (a prediction up to "
                f"{memory_gb * (1 - margin):.1f} GB): it may run out of memory"
                + ("" if elsewhere is None else f". {room_elsewhere_text(best, elsewhere, memory_gb, savers)}"))
    line = f"fits with {free}: room for the memory estimate's {margin:.1%} margin"
    edge = faster_at_the_edge(best, results, memory_gb, margin)
    if edge is not None:
        line += f"; chosen over a faster layout at the edge: {edge_risk(edge, best, memory_gb)}"
    return line


def room_elsewhere_text(best: Result, elsewhere, memory_gb: float, savers: frozenset = frozenset()) -> str:
    """No costed layout leaves the margin: the GPU count and the memory savers with which one does, or that
    neither was found."""
    options = []
    if elsewhere.on_more_gpus is not None:
        r = elsewhere.on_more_gpus
        options.append(f"on {elsewhere.gpus} GPUs the planner's first choice does: "
                       f"{r.layout.label()} at {r.memory_gb['total']:.1f} GB")
    for r, note in ((elsewhere.with_savers, ""), (elsewhere.with_lossy_savers, ", which changes the numbers")):
        if r is None:
            continue
        named = ", ".join(f"{k}={v}" for k, v in r.layout.extra.items() if k in savers) or "a memory saver"
        slower = 1 - r.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu
        options.append(f"on these GPUs with {named}{note}, one does: {r.layout.label()} at "
                       f"{r.memory_gb['total']:.1f} GB, {abs(slower):.1%} {'slower' if slower >= 0 else 'faster'}")
    if not options:
        return (f"No costed layout leaves that room, nor does one with the memory savers or on up to "
                f"{elsewhere.tried_up_to} GPUs. Fix: a shorter --seq-len or a GPU with more memory")
    return "No costed layout leaves that room; " + "; ".join(options)


def room_elsewhere_json(elsewhere, savers) -> dict:
    """``search.RoomElsewhere`` for ``--json``: the GPU count and the layouts that leave the margin (null: none
    found), and the largest GPU count searched."""
    def brief(r):
        if r is None:
            return None
        return {"layout": r.layout.label(), "memory_gb": round(r.memory_gb["total"], 2),
                "tokens_per_s_per_gpu": round(r.tokens_per_s_per_gpu, 1),
                **({"savers": {k: v for k, v in r.layout.extra.items() if k in savers}} if r.layout.extra else {})}

    return {"gpus": elsewhere.gpus, "on_more_gpus": brief(elsewhere.on_more_gpus),
            "with_savers": brief(elsewhere.with_savers), "with_lossy_savers": brief(elsewhere.with_lossy_savers),
            "gpus_searched_up_to": elsewhere.tried_up_to}


def breakdown(r: Result) -> str:
    mem = ", ".join(f"{k} {v:.1f}" for k, v in r.memory_gb.items() if k not in ("total", "host"))
    host = f"; host memory {r.memory_gb['host']:.1f} GB/GPU" if "host" in r.memory_gb else ""
    times = ", ".join(f"{dominant_name(k)} {v * 1000:.0f} ms" for k, v in r.times_s.items() if v > 0)
    return (f"memory GB/GPU: {mem} (total {r.memory_gb['total']:.1f}){host}; step {r.step_s:.2f} s: {times}\n"
            f"  model states: {r.bytes_per_param:.2f} bytes per parameter (weights, gradients and optimizer "
            "states of every GPU over the model's parameters)")


def saver_costs(best: Result, cost) -> str:
    """What each memory saver of the chosen layout (``ultrascale_cost_search``: searched because no layout fit
    without them) costs against the same layout without it; "" when it has none."""
    parts = []
    for name, value in best.layout.extra.items():
        if name not in cost.savers:
            continue
        without = cost.evaluate(best.layout.without(name))
        saved = without.memory_gb["total"] - best.memory_gb["total"]
        host = without.memory_gb.get("host", 0.0) - best.memory_gb.get("host", 0.0)
        host = f", {abs(host):.1f} GB {'less' if host >= 0 else 'more'} host memory" if abs(host) >= 0.05 else ""
        slower = best.step_s / without.step_s - 1
        parts.append(f"{name}={value}: {abs(saved):.1f} GB {'less' if saved >= 0 else 'more'} per GPU{host}, the "
                     f"step {abs(slower):.1%} {'longer' if slower >= 0 else 'shorter'} ({without.step_s:.2f} s "
                     "without it)")
    if not parts:
        return ""
    return "memory savers (searched because no layout fits without them): " + "; ".join(parts)


def parallel_fields(r: Result) -> dict:
    """The layout's ``ParallelConfig`` fields as the snippets print them: the data-parallel degree and ZeRO stage
    the plan chose, and every other field away from its default."""
    return {"dp_shard": r.layout.dp_shard, "zero_stage": r.layout.zero_stage, **r.layout.fields()}


def lightning_call(r: Result, gpus: int, per_node: int) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in parallel_fields(r).items())
    nodes = max(1, gpus // per_node)
    devices = min(gpus, per_node)
    ga = r.layout.grad_accum if r.layout.pp == 1 else 1  # a pipeline's micro-batches are its schedule's
    batch = r.layout.micro_batch_size if r.layout.pp == 1 else r.layout.micro_batch_size * r.layout.grad_accum
    return ("from ultrascale_plugins.integrations.lightning import UltraScaleStrategy\n"
            f"trainer = Trainer(strategy=UltraScaleStrategy({args}),\n"
            f"                  devices={devices}, num_nodes={nodes}, accelerator=\"gpu\", "
            f"accumulate_grad_batches={ga})\n"
            f"# DataLoader(..., batch_size={batch})  # sequences per GPU per step")


def accelerate_config(r: Result, gpus: int, per_node: int, accelerate_yaml) -> str:
    """``accelerate_yaml``: the adapters' writer of Accelerate config files (handed in by the CLI, so the core
    never imports the front ends)."""
    from ..interface.config import ParallelConfig

    config = ParallelConfig(**r.layout.fields())
    data = accelerate_yaml(config, gpus, False, max(1, gpus // per_node))
    if r.layout.pp == 1:
        data["gradient_accumulation_steps"] = r.layout.grad_accum
    return yaml.safe_dump(data, sort_keys=False).rstrip()


# The printed recipe's data: placeholders the user replaces (the built-in byte corpus is far too short for real
# sequence lengths, so a recipe for a real run names its data)
DATASET_PLACEHOLDER = "REPLACE/WITH/your-data.jsonl"
TOKENIZER_PLACEHOLDER = "REPLACE/WITH/your-tokenizer-directory"


def recipe(r: Result, gpus: int, per_node: int, model_fields: dict, seq_len: int, global_batch: int) -> str:
    """An ``ultrascale train`` recipe: ``nproc`` is per node, the launch line for several nodes above it."""
    nodes = max(1, gpus // per_node)
    data = {"nproc": min(gpus, per_node), "model": model_fields,
            "data": {"dataset": DATASET_PLACEHOLDER, "format": "text", "tokenizer": TOKENIZER_PLACEHOLDER,
                     "seq_len": seq_len},
            "train": {"global_batch": global_batch, "micro_batch_size": r.layout.micro_batch_size,
                      "grad_accum": r.layout.grad_accum},
            "parallel": parallel_fields(r)}
    launch = (f"# on each of the {nodes} nodes: ultrascale train FILE --nnodes {nodes} --node-rank N "
              "--rdzv-endpoint HOST:PORT" if nodes > 1 else "# ultrascale train FILE")
    head = [launch,
            f"# data.dataset: your .jsonl/.json/.parquet/.txt files or a save_to_disk directory (format: text or "
            "chat); data.tokenizer: its tokenizer (leave it out with --init-from HF_DIR, whose tokenizer is used)"]
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False).rstrip()


def peft_note(adapters, alpha: float | None = None) -> str:
    """What the snippets below leave to the user with ``--peft``: wrapping the model."""
    target = adapters.target if isinstance(adapters.target, str) else list(adapters.target)
    scale = "" if alpha is None else f", lora_alpha={alpha:g}"
    out = ("The snippets below parallelize the model as given: wrap it first, e.g.\n"
           f"    model = get_peft_model(model, LoraConfig(r={adapters.r}{scale}, target_modules={target!r}))  "
           "# from peft; docs/peft.md")
    if adapters.quantized:
        out += (f"\n    quantize_base(model, {adapters.quantized!r})  "
                "# ultrascale_plugins.features.peft.quantized_base: the adapted base weights in 4 bits (torchao)")
    return out


def as_json(results: list[Result], top: int, extra: dict, memory_gb: float | None = None,
            margin: float = MEMORY_MARGIN) -> str:
    """``{**extra, "candidates": [...]}``; with ``memory_gb``, each candidate's ``fits_with_margin`` and
    ``memory_free`` (the share of the GPU's memory its prediction leaves) and ``note`` where it has one."""
    notes = twin_notes(results, top)
    candidates = []
    for i, r in enumerate(results[:top]):
        row = r.to_json()
        if memory_gb is not None:
            row.update(fits_with_margin=has_headroom(r, memory_gb, margin),
                       memory_free=round(free_fraction(r, memory_gb), 4))
        if i in notes:
            row["note"] = notes[i]
        candidates.append(row)
    return json.dumps({**extra, "candidates": candidates}, indent=1)

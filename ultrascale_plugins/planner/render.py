"""What ``ultrascale plan`` prints: the ranked table, and for the chosen layout the ready-to-paste Lightning
strategy call, Accelerate config and ``ultrascale train`` recipe."""
from __future__ import annotations

import json

import yaml

from .cost import Result

_SHORT = {"compute": "compute", "bubble": "pipeline bubble"}


def dominant_name(key: str) -> str:
    return _SHORT.get(key, key.replace("comm_", "communication on ") if key.startswith("comm_") else key)


def table(results: list[Result], memory_gb: float, top: int) -> str:
    width = max([74] + [len(r.layout.label()) for r in results[:top]])
    head = (f"{'#':>3}  {'layout':<{width}} {'fits':<4} {'GB/GPU':>7} {'tok/s/GPU':>10} {'MFU':>6}  dominant cost")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(results[:top], 1):
        mark = "" if r.runnable else "  (not runnable here)"
        lines.append(f"{i:>3}  {r.layout.label():<{width}} {'yes' if r.fits else 'NO':<4} {r.memory_gb['total']:>7.1f} "
                     f"{r.tokens_per_s_per_gpu:>10,.0f} {r.mfu:>6.1%}  {dominant_name(r.dominant)}{mark}")
    lines.append(f"(memory limit {memory_gb:g} GB per GPU; {len(results)} layouts costed)")
    return "\n".join(lines)


def breakdown(r: Result) -> str:
    mem = ", ".join(f"{k} {v:.1f}" for k, v in r.memory_gb.items() if k != "total")
    times = ", ".join(f"{dominant_name(k)} {v * 1000:.0f} ms" for k, v in r.times_s.items() if v > 0)
    return f"memory GB/GPU: {mem} (total {r.memory_gb['total']:.1f}); step {r.step_s:.2f} s: {times}"


def parallel_fields(r: Result) -> dict:
    fields = r.layout.fields()
    defaults = {"dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1, "activation_checkpointing": "none",
                "mixed_precision": "no"}
    return {k: v for k, v in fields.items() if defaults.get(k, object()) != v}


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
    return ("The snippets below parallelize the model as given: wrap it first, e.g.\n"
            f"    model = get_peft_model(model, LoraConfig(r={adapters.r}{scale}, target_modules={target!r}))  "
            "# from peft; docs/peft.md")


def as_json(results: list[Result], top: int, extra: dict) -> str:
    return json.dumps({**extra, "candidates": [r.to_json() for r in results[:top]]}, indent=1)

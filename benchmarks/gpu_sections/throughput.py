"""Throughput of Llama-3.2-1B/3B (random weights, bf16) through ``parallelize`` at world size 1: tokens/s (median
of the timed steps after warm-up), MFU by the planner's FLOP formula, and peak memory against the planner's
prediction for this package's profile (what ``ultrascale plan`` prints)."""
from __future__ import annotations

import statistics
import time

import torch

from .common import Recorder, Sizes, free_memory, random_batches, synchronize

# (label, layout fields on top of bf16), most important first: a section cut short by its budget has these
MODES = {
    "compile": {"compile": "regional"},
    "eager": {},
    "compile+float8": {"compile": "regional", "float8": "tensorwise"},
    "eager, selective AC": {"activation_checkpointing": "selective"},
    "compile, selective AC": {"compile": "regional", "activation_checkpointing": "selective"},
    "eager+float8": {"float8": "tensorwise"},  # the dry run's float8 path (CPU _scaled_mm), without compiling
}
# the modes of each model: the 3B's are the ones the 1B's table is read against
MODELS = {"llama-3.2-1b": [m for m in MODES if m != "eager+float8"],
          "llama-3.2-3b": ["compile", "eager", "compile+float8"]}
# CPU dry run: inductor on 2 cores takes minutes per compiled model, so the compiled modes are recorded as skipped
# (section "compile" compiles the small model); everything else runs once, the 3B stand-in briefly
DRY_RUN_MODELS = {"llama-3.2-1b": ["eager", "eager, selective AC", "eager+float8", "compile", "compile+float8"],
                  "llama-3.2-3b": ["eager"]}
DRY_RUN_SKIPS = {"compile", "compile+float8"}
PEAK_PRESET = "h200-141gb"  # planner/hardware.py: dense bf16 peak the MFU is measured against
MEMORY_GOAL = 0.10  # measured peak within 10 % of the planner's prediction
MFU_GOAL = 0.45  # bf16 1B seq 4096 with compile


def model_config(name: str, sizes: Sizes):
    """The preset's config (planner/model_spec.py); in a dry run a tiny Llama standing in for it (narrow: the CPU's
    float8 ``_scaled_mm`` takes about 0.1 s per 128x128x128 product; widths stay multiples of 16 for float8)."""
    from transformers import LlamaConfig

    from ultrascale_plugins.planner.model_spec import load_model_config

    if sizes.dry_run:
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           tie_word_embeddings=True)
    return load_model_config(name)


def predicted_memory_gb(fields: dict, cfg, seq: int, micro_batch: int) -> float:
    """The planner's peak for this layout and shape (``engine.estimate`` + ``cost.peak_memory_gb``, as
    ``ultrascale plan``), in GB (1e9 bytes)."""
    from ultrascale_plugins.core import engine
    from ultrascale_plugins.interface.config import ParallelConfig
    from ultrascale_plugins.planner.cost import peak_memory_gb

    est = engine.estimate(ParallelConfig(**fields), cfg, world_size=1, seq_len=seq, micro_batch=micro_batch,
                          profile="ultrascale")
    return peak_memory_gb([est])["total"]


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> float:
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def memory_ratio(measured_gb: float | None, predicted_gb: float) -> float | None:
    return None if measured_gb is None else measured_gb / predicted_gb


def time_steps(pmodel, optimizer, batch: dict, warmup: int, timed: int) -> list[float]:
    """Seconds of each timed optimizer step (forward, backward, clip, AdamW), after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + timed):
        synchronize()
        start = time.perf_counter()
        pmodel.train_step(batch).item()
        pmodel.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def measure(cfg, fields: dict, sizes: Sizes, micro_batch: int) -> dict:
    """One run: build on the device (random weights; no CPU init of a billion parameters), parallelize, time."""
    import ultrascale_plugins as us
    from transformers import AutoModelForCausalLM

    from .common import device

    free_memory()
    torch.manual_seed(0)
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    pmodel = us.parallelize(model, us.ParallelConfig(**fields))
    fused = pmodel.device.type == "cuda"  # as the CLI's optimizer (train.py); the CPU dry run keeps it light
    optimizer = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-4, fused=fused)
    batch = random_batches(1, micro_batch, sizes.throughput_seq, cfg.vocab_size)[0]
    try:
        times = time_steps(pmodel, optimizer, batch, sizes.warmup, sizes.timed)
        peak = None
        if pmodel.device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated() / 1e9, torch.cuda.max_memory_reserved() / 1e9)
    finally:
        del pmodel, optimizer, model
        free_memory()
    return {"median_step_s": statistics.median(times), "peak": peak}


def run_mode(rec: Recorder, sizes: Sizes, name: str, cfg, spec, label: str, peak_tflops: float) -> None:
    from ultrascale_plugins.interface.config import ConfigError

    fields = {"mixed_precision": "bf16", **MODES[label]}
    row_name = f"{name} {label}"
    if sizes.dry_run and label in DRY_RUN_SKIPS:
        rec.skipped(row_name, "dry run: compiling on the CPU takes minutes (section 'compile' checks the compiled "
                    "model)")
        return
    micro_batch = sizes.micro_batch[name]
    while True:
        shape = {"seq": sizes.throughput_seq, "micro_batch": micro_batch, "layout": fields}
        try:
            result = measure(cfg, fields, sizes, micro_batch)
        except ConfigError as exc:  # the layout's own check refused it here (float8 on an older GPU, ...)
            rec.skipped(row_name, f"not available: {str(exc).splitlines()[0]}", **shape)
            return
        except torch.cuda.OutOfMemoryError:
            rec.add(row_name, "error", error=f"out of memory at micro-batch {micro_batch}", **shape)
            if micro_batch == 1:
                return
            micro_batch //= 2  # the smaller shape is still evidence
            continue
        break
    tokens_per_s = micro_batch * sizes.throughput_seq / result["median_step_s"]
    predicted = predicted_memory_gb(fields, cfg, sizes.throughput_seq, micro_batch)
    allocated, reserved = result["peak"] or (None, None)
    ratio = memory_ratio(allocated, predicted)
    value = mfu(tokens_per_s, spec.flops_per_token(sizes.throughput_seq), peak_tflops)
    goal = {"mfu_goal_met": value >= MFU_GOAL} if (name, label) == ("llama-3.2-1b", "compile") else {}
    rec.add(row_name, "ok", **shape, tokens_per_s=round(tokens_per_s, 1),
            mfu=float(f"{value:.4g}"), **goal,
            mfu_peak=f"{PEAK_PRESET} {peak_tflops:g} TFLOP/s",
            median_step_s=round(result["median_step_s"], 4), timed_steps=sizes.timed,
            peak_allocated_gb=None if allocated is None else round(allocated, 2),
            peak_reserved_gb=None if reserved is None else round(reserved, 2),
            planner_peak_gb=round(predicted, 2), measured_over_planner=None if ratio is None else round(ratio, 3),
            memory_within_goal=None if ratio is None else abs(ratio - 1) <= MEMORY_GOAL)


def throughput(rec: Recorder, sizes: Sizes, name: str) -> None:
    from ultrascale_plugins.planner.hardware import PRESETS
    from ultrascale_plugins.planner.model_spec import ModelSpec

    cfg = model_config(name, sizes)
    spec = ModelSpec.of(cfg, name)
    modes = (DRY_RUN_MODELS if sizes.dry_run else MODELS)[name]
    for label in modes:
        run_mode(rec, sizes, name, cfg, spec, label, PRESETS[PEAK_PRESET].tflops)


def throughput_1b(rec: Recorder, sizes: Sizes) -> None:
    throughput(rec, sizes, "llama-3.2-1b")


def throughput_3b(rec: Recorder, sizes: Sizes) -> None:
    throughput(rec, sizes, "llama-3.2-3b")

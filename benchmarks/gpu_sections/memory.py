"""The package's own memory estimate against the measured peak of whole training steps on one device: the per-rank
bytes the pre-launch check and ``layout: auto`` rely on (``Estimate.total_memory``), beside
``torch.cuda.max_memory_allocated`` over a step (gradient accumulation over two micro-batches, clipping, foreach
AdamW, ``zero_grad``), and the planner's figure with its allocator constants beside ``max_memory_reserved``.
The multi-process layouts are measured on CPU processes by ``benchmarks/own_memory.py`` (one GPU cannot run them);
in the dry run this section measures with that benchmark's storage ledger (``tests/memory_worker.py``)."""
from __future__ import annotations

import functools

import torch

from .common import Recorder, Sizes, device, free_memory, random_batches, synchronize

MEMORY_TOL = 0.10  # |measured - estimate| / measured, as the CPU launches are held to (tests/test_estimates.py)
# one device's layouts: the precisions and recomputation (what changes the activations and the optimizer step),
# and the memory features each beside its "off" above: the chunked loss (bf16 beside it), the weights, gradients and
# AdamW states held in bf16 (bf16 compute on fp32 states beside it)
LAYOUTS = {"fp32": {}, "bf16": {"mixed_precision": "bf16"},
           "bf16, full recomputation": {"mixed_precision": "bf16", "activation_checkpointing": "full"},
           "bf16, chunked loss": {"mixed_precision": "bf16", "chunked_loss": 1024},
           "bf16 weights and states": {"param_dtype": "bf16"},
           # offload, each beside "bf16" (on), the step inside the backward beside "bf16, one micro-batch" (its
           # loop: one micro-batch per step, no clipping)
           "bf16, states offloaded": {"mixed_precision": "bf16", "zero_stage": 3, "cpu_offload": True},
           "bf16, activations offloaded": {"mixed_precision": "bf16", "activation_offload": True},
           "bf16, full recomputation, activations offloaded": {"mixed_precision": "bf16", "activation_offload": True,
                                                               "activation_checkpointing": "full"},
           "bf16, one micro-batch": {"mixed_precision": "bf16", "zero_stage": 3},
           "bf16, one micro-batch, step in the backward": {"mixed_precision": "bf16", "zero_stage": 3,
                                                           "optimizer_in_backward": True}}
ONE_MICRO_BATCH = ("bf16, one micro-batch", "bf16, one micro-batch, step in the backward")
# on the GPU a model whose bytes dwarf the CUDA libraries' workspaces (about 160M parameters); the dry run: tiny
GPU_MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                 tie_word_embeddings=False)
GPU_ROWS, GPU_SEQ = 8, 1024
DRY_MODEL = dict(vocab_size=2000, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def memory(rec: Recorder, sizes: Sizes) -> None:
    import memory_worker  # tests/: the CPU benchmark's step and ledger
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ultrascale_plugins as us
    from ultrascale_plugins.planner.cost import GB, peak_memory_gb

    # the dry run: a tiny Llama of 4 layers whose activations are about half of the peak, as on the GPU
    fields = DRY_MODEL if sizes.dry_run else GPU_MODEL
    rows, seq = (4, 64) if sizes.dry_run else (GPU_ROWS, GPU_SEQ)
    for label, layout in LAYOUTS.items():
        one = label in ONE_MICRO_BATCH  # a step of one micro-batch (half the rows), else two: the first under no_sync
        micro = rows // 2
        free_memory()
        torch.manual_seed(0)
        cfg = LlamaConfig(**fields)
        with torch.device(device()):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        pmodel = us.parallelize(model, us.ParallelConfig(**layout))
        opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-4, foreach=True)  # torch's default on a GPU
        batches = random_batches(3, micro if one else rows, seq, cfg.vocab_size)
        for batch in batches[:2]:  # the optimizer's states exist from the first step on
            memory_worker.optimizer_step(pmodel, opt, batch, micro, clip=not one)
        synchronize()
        reserved = None
        if pmodel.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            memory_worker.optimizer_step(pmodel, opt, batches[2], micro, clip=not one)
            synchronize()
            measured, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            at = "max_memory_allocated"
        else:
            ledger = memory_worker.LiveStorages(pmodel, opt)
            with ledger:
                memory_worker.optimizer_step(pmodel, opt, batches[2], micro, ledger, clip=not one)
            measured, at = ledger.peak, f"{ledger.peak_at['phase']} {ledger.peak_at['op']}"
        est = us.estimate(pmodel.config, cfg, world_size=1, seq_len=seq, micro_batch=micro,
                          micro_batches=1 if one else 2, optimizer="adamw", check=False)
        planner = peak_memory_gb([est])["total"]
        predicted = est.total_memory
        if pmodel.device.type != "cuda" and (est.on_host or est.host_bytes):  # the dry run: the host is the device
            import dataclasses

            predicted = dataclasses.replace(est, on_host=set()).total_memory + est.host_bytes
        # a step of one micro-batch: measured, beside the estimate, not held to its tolerance. The estimate counts
        # the step's gradients at the start of the loss's backward, which only accumulation holds there (the CPU
        # dry run: about +15 %)
        report = (functools.partial(rec.add, status="ok", error=round((predicted - measured) / measured, 4))
                  if one else functools.partial(rec.check, diff=abs(predicted - measured) / measured, tol=MEMORY_TOL))
        report(f"memory estimate vs measured peak, one device, {label}" + ("" if one else ": |difference| / measured"),
               measured_gb=round(measured / GB, 4),
               estimate_gb=round(predicted / GB, 4), host_gb=round(est.host_memory / GB, 4), measured_at=at,
               reserved_gb=None if reserved is None else round(reserved / GB, 4), planner_gb=round(planner, 4),
               reserved_over_planner=None if reserved is None else round(reserved / GB / planner, 3),
               params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1), rows=micro if one else rows,
               seq=seq, micro_batches=1 if one else 2, device=str(pmodel.device))
        del pmodel, opt, model
    free_memory()

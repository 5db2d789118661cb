"""The sections of ``benchmarks/gpu_suite.py``: each is a function ``section(rec, sizes)`` that appends result rows
to ``rec`` as it goes (see ``common.Recorder``), so a section killed by its time budget still leaves its evidence.

    common.py       sizes (GPU or CPU dry run), the row recorder, models, batches, differences
    correctness.py  checks against a reference with a stated tolerance (bf16, meta init, checkpoints, AdamW,
                    compile, context-parallel kernels, MoE)
    throughput.py   tokens/s, MFU and peak memory of Llama-3.2-1B/3B against the planner's prediction
    front_ends.py   the Lightning strategy and the Accelerate plugin against their own FSDP2 (and the worker)
    report.py       the JSON and markdown files the suite writes
"""

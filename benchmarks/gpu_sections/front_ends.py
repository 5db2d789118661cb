"""The 1B through the front ends at world size 1, bf16: the Lightning strategy (``UltraScaleStrategy``) against
Lightning's own FSDP2 path (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``), and the Accelerate
plugin (``UltraScaleAccelerator``) against Accelerate's own FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``).

Each implementation runs in its own process, a world of one with torchrun's variables (Lightning's and
Accelerate's state is process-wide); this module is also that worker:

    RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 PYTHONPATH=benchmarks \
        python -m gpu_sections.front_ends IMPL OUT.json SIZES_JSON
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import BENCHMARKS, Recorder, Sizes, device, quiet, random_batches, synchronize, world_of_one_env

IMPLS = {  # front end -> (ours, theirs)
    "lightning": ("lightning_ours", "lightning_fsdp2"),
    "accelerate": ("accelerate_ours", "accelerate_fsdp2"),
}
MODEL = "llama-3.2-1b"
OVERHEAD_GOAL = 1.00  # ours' step time / theirs'


def _model(sizes: Sizes):
    """The 1B (a tiny stand-in in a dry run) with random weights, built on the device: no CPU init to wait for."""
    from transformers import AutoModelForCausalLM

    from .throughput import model_config

    torch.manual_seed(0)
    with torch.device(device()):
        return AutoModelForCausalLM.from_config(model_config(MODEL, sizes), attn_implementation="sdpa")


def _rows(sizes: Sizes) -> list[dict]:
    from .throughput import model_config

    vocab = model_config(MODEL, sizes).vocab_size
    batch = random_batches(1, sizes.front_end_micro_batch * sizes.front_end_steps, sizes.throughput_seq, vocab)[0]
    return [{"input_ids": ids, "labels": ids} for ids in batch["input_ids"]]


def _bf16_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# ---- Lightning ---------------------------------------------------------------------------------------------
def lightning(impl: str, sizes: Sizes) -> dict:
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning_side_by_side import Timer
    from torch.utils.data import DataLoader

    from ultrascale_plugins.integrations.lightning import UltraScaleStrategy

    ours = impl == "lightning_ours"

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model(sizes)

        def configure_model(self):
            if ours:
                return  # the strategy parallelizes the HF model itself
            from torch.distributed.fsdp import fully_shard

            mesh, policy = self.device_mesh["data_parallel"], _bf16_policy()
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(self.model, mesh=mesh, mp_policy=policy)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=device().type == "cuda")

    # ours: bf16 through the strategy's precision (FSDP2 mixed precision inside); theirs: the same policy by hand
    strategy = UltraScaleStrategy() if ours else ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    timer = Timer()
    trainer = L.Trainer(accelerator=device().type, devices=1, strategy=strategy, max_steps=sizes.front_end_steps,
                        precision="bf16-mixed" if ours else "32-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(Module(), DataLoader(_rows(sizes), batch_size=sizes.front_end_micro_batch))
    return {"times": timer.times[sizes.warmup:], "backend": type(strategy).__name__}


# ---- Accelerate --------------------------------------------------------------------------------------------
def _accelerator(impl: str):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from ultrascale_plugins.integrations.accelerate import UltraScaleAccelerator, UltraScalePlugin

    cpu = device().type == "cpu"
    if impl == "accelerate_ours":
        return UltraScaleAccelerator(ultrascale_plugin=UltraScalePlugin(zero_stage=3), mixed_precision="bf16")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    return Accelerator(cpu=cpu, mixed_precision="bf16", fsdp_plugin=plugin)


def accelerate(impl: str, sizes: Sizes) -> dict:
    from torch.utils.data import DataLoader

    accelerator = _accelerator(impl)
    model = _model(sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device().type == "cuda")
    loader = DataLoader(_rows(sizes), batch_size=sizes.front_end_micro_batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    times = []
    for batch in loader:
        synchronize()
        start = time.perf_counter()
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        synchronize()
        times.append(time.perf_counter() - start)
    return {"times": times[sizes.warmup:], "backend": str(accelerator.distributed_type)}


# ---- the section -------------------------------------------------------------------------------------------
def run_worker(impl: str, sizes: Sizes, out: Path, timeout: float) -> dict:
    env = world_of_one_env(sizes.dry_run)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "gpu_sections.front_ends", impl, str(out), sizes.to_json()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{impl} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    return json.loads(out.read_text())


def compare(rec: Recorder, sizes: Sizes, front_end: str, tmp: Path, timeout: float) -> None:
    ours_impl, theirs_impl = IMPLS[front_end]
    tokens = sizes.front_end_micro_batch * sizes.throughput_seq
    results = {}
    for impl in (ours_impl, theirs_impl):
        try:
            results[impl] = run_worker(impl, sizes, tmp / f"{impl}.json", timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rec.add(f"{front_end}: {impl}", "error", error=str(exc)[-1500:])
            return
    ours, theirs = (statistics.median(results[i]["times"]) for i in (ours_impl, theirs_impl))
    like_for_like = "FSDP" in results[theirs_impl]["backend"] or front_end == "lightning"
    note = {} if like_for_like else {"note": f"Accelerate ran {results[theirs_impl]['backend']}, not FSDP (it runs "
                                              "FSDP only on accelerators): not like for like"}
    rec.add(f"{front_end}: ours vs own FSDP2", "ok", model=MODEL, seq=sizes.throughput_seq,
            micro_batch=sizes.front_end_micro_batch, timed_steps=len(results[ours_impl]["times"]),
            ours_tokens_per_s=round(tokens / ours, 1), theirs_tokens_per_s=round(tokens / theirs, 1),
            tokens_per_s_ratio_ours_over_theirs=round(theirs / ours, 3),
            overhead_ours_over_theirs=round(ours / theirs, 3),
            overhead_goal_met=ours / theirs <= OVERHEAD_GOAL, theirs_backend=results[theirs_impl]["backend"],
            like_for_like=like_for_like, **note)


def front_ends(rec: Recorder, sizes: Sizes) -> None:
    import tempfile

    timeout = 120 if sizes.dry_run else 150  # one launch; the section's own budget bounds them all
    with tempfile.TemporaryDirectory() as tmp:
        for front_end in IMPLS:
            compare(rec, sizes, front_end, Path(tmp), timeout)


def main() -> None:
    impl, out, sizes = sys.argv[1], Path(sys.argv[2]), Sizes.from_json(sys.argv[3])
    quiet()
    result = (lightning if impl.startswith("lightning") else accelerate)(impl, sizes)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""Adapter-only checkpoints of a PEFT model, and what they export to (see tests/test_peft_checkpoints.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/peft_checkpoint_worker.py OUT_DIR

One launch: rank 0 writes a tiny Llama as a pretrained directory, both ranks build a PEFT model on it (LoRA on every
linear layer plus a trained copy of the head, ``modules_to_save``), train it under ZeRO-3 (SGD with momentum,
clipping active, as tests/peft_worker.py) and save sharded checkpoints after steps 2 and 4. Then: resume step 2
under ZeRO-3 (bit for bit), DDP and ZeRO-1 (within 1e-5 of the uninterrupted run); a base that differs in one weight
by 1e-4 (under ZeRO-3: the fingerprint is compared shard by shard) and other adapters are refused, leaving the model
as built; a full checkpoint (the plugin unregistered: what was written before) gives the bytes to compare and still
loads. Rank 0 writes the results, the run's own gathered adapters and the one-process reference's to OUT_DIR.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import padded_batches, rows  # noqa: E402
from peft_worker import LR, MOMENTUM, STEPS, base_model, reference, train_steps  # noqa: E402

import ultrascale_plugins as us  # noqa: E402
from ultrascale_plugins.checkpoints.errors import CheckpointError  # noqa: E402
from ultrascale_plugins.checkpoints.sharded import SafeReader, load_checkpoint, save_checkpoint  # noqa: E402

warnings.filterwarnings("ignore")
EXTRA = {"modules_to_save": ["lm_head"]}
PLUGIN = "ultrascale_plugins.features.peft.checkpoints"
EVAL = padded_batches(STEPS + 1)[STEPS]  # a batch no step trains on


def peft_on(base_dir: str, r: int = 4, nudge: bool = False):
    """The PEFT model of tests/peft_worker.py's ``peft_model("llama", EXTRA)`` (same seeds), on the pretrained
    directory (so PEFT records it as base_model_name_or_path); ``nudge``: one base weight moved by 1e-4."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa")
    if nudge:
        with torch.no_grad():
            base.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-4
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                           modules_to_save=EXTRA["modules_to_save"]))


def steps(pmodel, opt, which) -> list[float]:
    return train_steps(pmodel, opt, padded_batches(STEPS), which)


def build(base_dir: str, layout: dict, **kw):
    pmodel = us.parallelize(peft_on(base_dir, **kw), us.ParallelConfig(**layout))
    return pmodel, pmodel.build_optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)


def adapters(pmodel) -> dict:
    trainable = {n for n, p in pmodel.module.named_parameters() if p.requires_grad}
    return {k: v for k, v in pmodel.full_state_dict().items() if k in trainable}


def checkpoint_bytes(path) -> int:
    return sum(json.loads((path / "ultrascale.json").read_text())["files"].values())


def main() -> None:
    from ultrascale_plugins import get_plugin_manager
    from ultrascale_plugins.features.peft.checkpoints import KEY, fingerprint, fingerprint_rel_difference, frozen_state

    out = os.path.abspath(sys.argv[1])
    base_dir, ckpts, full_dir = f"{out}/base", f"{out}/ckpt", f"{out}/full"
    us.init_distributed(timeout=120)
    rank = dist.get_rank()
    if rank == 0:
        base_model("llama").save_pretrained(base_dir)
    dist.barrier()
    r: dict = {}

    # the uninterrupted run under ZeRO-3, saved after steps 2 and 4
    pmodel, opt = build(base_dir, {"dp_shard": 2})
    losses = steps(pmodel, opt, range(2))
    step2 = save_checkpoint(pmodel, opt, ckpts, step=2, extra={"data_position": 2})
    losses += steps(pmodel, opt, range(2, STEPS))
    step4 = save_checkpoint(pmodel, opt, ckpts, step=STEPS, extra={"data_position": STEPS})
    r["losses"] = losses
    r["eval_loss"] = pmodel.eval_step(rows(EVAL, pmodel.data_parallel_rank, pmodel.data_parallel_size)).item()
    run_adapters = adapters(pmodel)
    names = set(SafeReader(str(step4)).read_metadata().state_dict_metadata)
    meta = json.loads((step4 / "ultrascale.json").read_text())
    saved_base = meta["plugins"][KEY]["base"]
    r["frozen"] = sorted(frozen_state(pmodel))
    r["model_tensors"] = sorted(n[len("model."):] for n in names if n.startswith("model."))
    r["optim_tensors"] = sorted(n[len("optim."):] for n in names if n.startswith("optim."))
    r["trainable"] = sorted(run_adapters)
    r["adapter_only_bytes"] = checkpoint_bytes(step4)

    # what was written before adapter-only checkpoints: the whole model (the plugin unregistered)
    pm = get_plugin_manager()
    plugin = pm.unregister(name=PLUGIN)
    try:
        full = save_checkpoint(pmodel, opt, full_dir, step=STEPS)
    finally:
        pm.register(plugin, name=PLUGIN)
    r["full_bytes"] = checkpoint_bytes(full)
    r["full_model_tensors"] = sum(1 for n in SafeReader(str(full)).read_metadata().state_dict_metadata
                                  if n.startswith("model."))
    del pmodel, opt

    # resumed from step 2: the same layout bit for bit, others within 1e-5
    r["resumed"], r["fingerprint_rel_diff"] = {}, {}
    for name, layout in (("zero3", {"dp_shard": 2}), ("ddp", {"dp_shard": 2, "zero_stage": 0}),
                         ("zero1", {"dp_shard": 2, "zero_stage": 1})):
        torch.manual_seed(7)  # other adapters to start from: the load must replace them
        fresh, fresh_opt = build(base_dir, layout)
        r["fingerprint_rel_diff"][name] = fingerprint_rel_difference(saved_base, fingerprint(frozen_state(fresh)))
        meta2 = load_checkpoint(fresh, fresh_opt, step2)
        r["resumed"][name] = {"losses": steps(fresh, fresh_opt, range(meta2["extra"]["data_position"], STEPS)),
                              "data_position": meta2["extra"]["data_position"]}
        if name == "zero3":
            final = adapters(fresh)
            r["resumed"][name]["adapters_equal"] = all(torch.equal(final[k], run_adapters[k]) for k in run_adapters)
        del fresh, fresh_opt

    # refused before anything is read: a base one weight away (ZeRO-3: compared shard by shard), other adapters
    r["refused"] = {}
    for name, kw in (("nudged_base", {"nudge": True}), ("other_rank", {"r": 8})):
        wrong, wrong_opt = build(base_dir, {"dp_shard": 2}, **kw)
        before = wrong.full_state_dict()
        try:
            load_checkpoint(wrong, wrong_opt, step2)
            r["refused"][name] = {"error": None}
        except CheckpointError as exc:
            after = wrong.full_state_dict()
            r["refused"][name] = {"error": str(exc), "unchanged": all(torch.equal(after[k], before[k])
                                                                       for k in before),
                                  "no_optimizer_state": not any(wrong_opt.state.values())}
        del wrong, wrong_opt

    # the full checkpoint (no fingerprint, the base inside) still loads, base and adapters from it
    old, old_opt = build(base_dir, {"dp_shard": 2, "zero_stage": 0})
    load_checkpoint(old, old_opt, full)
    loaded = adapters(old)
    r["full_checkpoint_loads"] = all(torch.equal(loaded[k], run_adapters[k]) for k in run_adapters)
    del old, old_opt

    if rank == 0:
        ref = reference("llama", EXTRA)
        r["ref_losses"] = ref["losses"]
        torch.save(run_adapters, f"{out}/run_adapters.pt")
        torch.save({k: ref["state"][k] for k in run_adapters}, f"{out}/ref_adapters.pt")
        torch.save(EVAL, f"{out}/eval_batch.pt")
        with open(f"{out}/results.json", "w") as f:
            json.dump(r, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main_tp_sp() -> None:
    """Four processes: the same run under ZeRO-3 x TP + SP (dp_shard 2, tp 2), saved after step 4, for the exports
    (every rank's shards gathered from DCP) against the run's own adapters and the one-process run's."""
    out = os.path.abspath(sys.argv[1])
    base_dir, ckpts = f"{out}/base", f"{out}/ckpt"
    us.init_distributed(timeout=120)
    if dist.get_rank() == 0:
        base_model("llama").save_pretrained(base_dir)
    dist.barrier()
    pmodel, opt = build(base_dir, {"dp_shard": 2, "tp": 2, "sequence_parallel": True})
    losses = steps(pmodel, opt, range(STEPS))
    save_checkpoint(pmodel, opt, ckpts, step=STEPS, extra={"data_position": STEPS})
    eval_loss = pmodel.eval_step(rows(EVAL, pmodel.data_parallel_rank, pmodel.data_parallel_size)).item()
    run_adapters = adapters(pmodel)
    if dist.get_rank() == 0:
        ref = reference("llama", EXTRA)
        torch.save(run_adapters, f"{out}/run_adapters.pt")
        torch.save({k: ref["state"][k] for k in run_adapters}, f"{out}/ref_adapters.pt")
        torch.save(EVAL, f"{out}/eval_batch.pt")
        with open(f"{out}/results.json", "w") as f:
            json.dump({"losses": losses, "ref_losses": ref["losses"], "eval_loss": eval_loss,
                       "trainable": sorted(run_adapters)}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main_tp_sp() if sys.argv[2:] == ["tp_sp"] else main()

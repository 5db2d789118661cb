"""Save / resume / reshard across layouts, on every rank of a torchrun launch (see tests/test_checkpoint.py).

    save_and_reshard OUT_DIR   (4 ranks) train layout dp_shard=4, save at step 3, continue to step 6; resume in the
                               same layout (must be bit-exact), in tp2 x dp2 + SP; save from pp2 x tp2 and resume
                               in dp_shard=4. Writes OUT_DIR/save_and_reshard.json.
                               ZeRO-1 (partitioned optimizer state) saves and resumes too. Checksums: which files
                               each rank hashes at save and verifies at load; a flipped shard refused on every rank.
                               Pretrained weights (its "pretrained" entry, the same launch: a 4-rank start-up is
                               most of a short run's time): a sharded save_pretrained directory loaded into several
                               layouts from the meta device; weights, logits and loss compared with transformers'
                               own load.
    reshard_world OUT_DIR      (2 ranks) resume the 4-rank dp_shard=4 checkpoint with tp=2.
"""
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_model, padded_batches, rows, train_steps  # noqa: E402

import ultrascale_plugins as us  # noqa: E402
from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint  # noqa: E402

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
ARCH, STEPS, SAVE_AT = "llama8_tied", 6, 3
BATCHES = padded_batches(STEPS)


def build(layout: dict, seed: int = 0):
    pmodel = us.parallelize(make_model(ARCH, seed=seed), us.ParallelConfig(**layout))
    return pmodel, pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)


def train(pmodel, opt, steps) -> list[float]:
    return train_steps(pmodel, opt, steps, BATCHES)


def resumed(layout: dict, path) -> list[float]:
    pmodel, opt = build(layout, seed=7)  # different initial weights: everything must come from the checkpoint
    meta = load_checkpoint(pmodel, opt, path)
    assert meta["step"] == SAVE_AT and meta["extra"]["data_position"] == SAVE_AT
    return train(pmodel, opt, range(meta["extra"]["data_position"], STEPS))


def async_save(layout: dict, directory: Path) -> dict:
    """A checkpoint written in the background while the next steps train (their optimizer updates the very
    tensors being written): it appears only when committed, and resumes the uninterrupted run exactly."""
    pmodel, opt = build(layout)
    first = train(pmodel, opt, range(SAVE_AT))
    pending = save_checkpoint(pmodel, opt, directory, step=SAVE_AT, extra={"data_position": SAVE_AT},
                              asynchronous=True)
    hidden = not pending.final.exists()
    rest = []
    for step in range(SAVE_AT, STEPS):
        rest += train(pmodel, opt, [step])
        pending.poll()
    pending.wait()
    return {"async_hidden_until_committed": hidden, "async_uninterrupted": first + rest,
            "async_same_layout": resumed(layout, pending.final)}


def checksum_shares(directory: Path) -> dict:
    """Who hashes what: at save each rank its own files (rank 0 also DCP's .metadata); at load each rank a disjoint
    share; a shard with flipped bytes (same size) refused on every rank, naming it, before anything is loaded."""
    from ultrascale_plugins.checkpoints import checksums
    from ultrascale_plugins.checkpoints.errors import CheckpointError

    real, hashed = checksums.file_digest, []
    checksums.file_digest = lambda p: (hashed.append(str(p).split(f"step-{1:08d}/", 1)[1]), real(p))[1]
    try:
        pmodel, opt = build({"dp_shard": 4})
        train(pmodel, opt, range(1))
        ckpt = save_checkpoint(pmodel, opt, directory, step=1)
        saved, hashed[:] = sorted(hashed), []
        load_checkpoint(pmodel, opt, ckpt)
        verified = sorted(hashed)
    finally:
        checksums.file_digest = real
    shard = ckpt / "__2_0.distcp"
    if dist.get_rank() == 0:
        data = bytearray(shard.read_bytes())
        data[64:4064] = bytes(b ^ 0x5A for b in data[64:4064])
        shard.write_bytes(data)
    dist.barrier()
    refused = None
    try:
        load_checkpoint(pmodel, opt, ckpt)
    except CheckpointError as exc:
        refused = str(exc)
    mine = {"saved": saved, "verified": verified, "refused": refused}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"checksums": every}


PRETRAINED_LAYOUTS = {
    "dp_shard4": {"dp_shard": 4},
    "tp2_dp2_sp": {"tp": 2, "dp_shard": 2, "sequence_parallel": True},
    "ddp4": {"zero_stage": 0},
    "pp2_tp2": {"pp": 2, "tp": 2, "dp_shard": 1},
    "pp2_zbv_dp2": {"pp": 2, "dp_shard": 2, "pp_schedule": "zbv"},
    "pp4_interleaved": {"pp": 4, "dp_shard": 1, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
}


def pretrained(out: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.checkpoints.load import from_pretrained

    hf_dir = out / "hf"
    if dist.get_rank() == 0:  # several safetensors files, tied head stored once
        make_model(ARCH, seed=3).save_pretrained(hf_dir, max_shard_size="200KB")
    dist.barrier()
    ref = AutoModelForCausalLM.from_pretrained(hf_dir)
    ref_state = ref.state_dict()
    batch = BATCHES[0]
    with torch.no_grad():
        ref_logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    result = {"files": len(list(hf_dir.glob("*.safetensors")))}
    for name, layout in PRETRAINED_LAYOUTS.items():
        pmodel = from_pretrained(hf_dir, us.ParallelConfig(**layout))
        full = pmodel.full_state_dict()
        r = {"keys_equal": set(full) == set(ref_state),
             "weight_diff": max((full[k] - ref_state[k]).abs().max().item() for k in ref_state)}
        local = rows(batch, pmodel.data_parallel_rank, pmodel.data_parallel_size)
        ref_loss = ref(**batch).loss.item()
        r["loss_diff"] = abs(pmodel.eval_step(local).item() - ref_loss)
        if layout.get("pp", 1) == 1:
            with torch.no_grad():
                logits = pmodel(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            r["logits_diff"] = (logits - ref_logits).abs().max().item()
        result[name] = r
    return result


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    us.init_distributed(timeout=120)
    result = {}
    if mode == "save_and_reshard":
        a = {"dp_shard": 4}
        pmodel, opt = build(a)
        first = train(pmodel, opt, range(SAVE_AT))
        ckpt = save_checkpoint(pmodel, opt, out / "dp4", step=SAVE_AT, extra={"data_position": SAVE_AT})
        result["uninterrupted"] = first + train(pmodel, opt, range(SAVE_AT, STEPS))
        result["same_layout"] = resumed(a, ckpt)
        result["tp2_dp2_sp"] = resumed({"dp_shard": 2, "tp": 2, "sequence_parallel": True}, ckpt)
        result.update(async_save(a, out / "async"))
        pmodel, opt = build({"pp": 2, "tp": 2, "dp_shard": 1})
        train(pmodel, opt, range(SAVE_AT))
        ckpt_pp = save_checkpoint(pmodel, opt, out / "pp2tp2", step=SAVE_AT, extra={"data_position": SAVE_AT})
        result["pp2_tp2_to_dp4"] = resumed(a, ckpt_pp)
        result["dp4_to_pp2_zbv_dp2"] = resumed({"pp": 2, "dp_shard": 2, "pp_schedule": "zbv"}, ckpt)
        result["dp4_to_zero1"] = resumed({"zero_stage": 1}, ckpt)
        result["dp4_to_cp2_tp2_sp"] = resumed({"cp": 2, "tp": 2, "sequence_parallel": True, "dp_shard": 1}, ckpt)
        result["dp4_to_cp2_ulysses_dp2"] = resumed({"cp": 2, "cp_method": "ulysses", "dp_shard": 2}, ckpt)
        pmodel, opt = build({"zero_stage": 1})  # ZeRO-1: each rank writes the optimizer states it owns
        first = train(pmodel, opt, range(SAVE_AT))
        ckpt_z1 = save_checkpoint(pmodel, opt, out / "zero1", step=SAVE_AT, extra={"data_position": SAVE_AT})
        result["zero1_uninterrupted"] = first + train(pmodel, opt, range(SAVE_AT, STEPS))
        result["zero1_same_layout"] = resumed({"zero_stage": 1}, ckpt_z1)
        result["zero1_to_tp2_dp2"] = resumed({"dp_shard": 2, "tp": 2}, ckpt_z1)
        # ZeRO-1 over tensor parallel (FSDP2 over the data-parallel ranks): resumes from, and reshards to, dp4
        result["dp4_to_zero1_tp2"] = resumed({"zero_stage": 1, "dp_shard": 2, "tp": 2}, ckpt)
        pmodel, opt = build({"zero_stage": 1, "dp_shard": 2, "tp": 2})
        train(pmodel, opt, range(SAVE_AT))
        ckpt_z1tp = save_checkpoint(pmodel, opt, out / "zero1tp2", step=SAVE_AT, extra={"data_position": SAVE_AT})
        result["zero1_tp2_to_dp4"] = resumed(a, ckpt_z1tp)
        result.update(checksum_shares(out / "checksums"))
        result["pretrained"] = pretrained(out)
    else:
        result["tp2_from_4_ranks"] = resumed({"tp": 2, "dp_shard": 1}, out / "dp4" / f"step-{SAVE_AT:08d}")
    if dist.get_rank() == 0:
        (out / f"{mode}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Checkpoints of a tensor-parallel mixture-of-experts model: its fused gate|up expert weight is a packed
(``_StridedShard``) parameter, each rank holding its slice of gate AND its slice of up. The checkpoint must hold
the plain global tensor (and the optimizer states alike), so it saves, resumes exactly, and loads into any other
layout.

This file is also the worker (``python -m torch.distributed.run ... tests/test_tp_moe_checkpoint.py MODE OUT``):

    tp2 OUT   (2 ranks) train tp=2 to step 3, save, continue to step 6; resume tp=2 (same losses); load into
              dp_shard=2 (ZeRO-3), continue, save from there and load that into tp=2 again
    tp1 OUT   (1 rank) load the tp=2 checkpoint into one process, continue
    fake OUT  (one process, fake process group) describe packed DTensors' local pieces for every rank of a
              tp mesh and of a dp_shard x tp mesh
"""
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import torchrun  # noqa: E402
from models import VOCAB, padded_batches, train_steps  # noqa: E402

STEPS, SAVE_AT = 6, 3


def make_moe(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


# ---- worker ------------------------------------------------------------------------------------------------
def _build(layout: dict, seed: int = 0):
    import ultrascale_plugins as us

    pmodel = us.parallelize(make_moe(seed), us.ParallelConfig(**layout))
    return pmodel, pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)


def _weight_diff(pmodel, expected: dict) -> float:
    full = pmodel.full_state_dict()
    assert set(full) == set(expected), sorted(set(full) ^ set(expected))
    return max((full[k].float() - expected[k].float()).abs().max().item() for k in expected)


def _resume(layout: dict, path, expected: dict, batches) -> dict:
    from ultrascale_plugins.checkpoints.sharded import load_checkpoint

    pmodel, opt = _build(layout, seed=7)  # other initial weights: everything must come from the checkpoint
    meta = load_checkpoint(pmodel, opt, path)
    assert meta["step"] == SAVE_AT
    diff = _weight_diff(pmodel, expected)
    return {"weight_diff": diff, "losses": train_steps(pmodel, opt, range(SAVE_AT, STEPS), batches),
            "pmodel": pmodel, "opt": opt}


def _packed_params(pmodel) -> list[str]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return [n for m in pmodel.modules for n, p in m.named_parameters()
            if isinstance(p, DTensor) and any(isinstance(pl, _StridedShard) for pl in p.placements)]


def _fake() -> dict:
    """checkpoint_view's pieces, for every rank of a fake mesh: they tile the global tensor, each is the
    global tensor's block at its offset, and each is a view of the local shard (a load fills the parameter)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ultrascale_plugins.dims.tensor.styles import checkpoint_view, param_placement

    full = torch.arange(8 * 64 * 12, dtype=torch.float32).view(8, 64, 12)
    cases = {"tp2": ((2,), ("tp",), [param_placement("packed_colwise", 3)]),
             "tp4": ((4,), ("tp",), [param_placement("packed_colwise", 3)]),
             "rowwise_tp2": ((2,), ("tp",), [_StridedShard(1, split_factor=2)]),
             "dp2_tp2": ((2, 2), ("dp_shard", "tp"), [Shard(0), param_placement("packed_colwise", 3)])}
    result = {}
    for name, (shape, names, placements) in cases.items():
        world = 1
        for s in shape:
            world *= s
        covered = torch.zeros(full.shape, dtype=torch.int32)
        pieces_per_rank = []
        for rank in range(world):
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            dt = distribute_tensor(full, mesh, placements, src_data_rank=None)  # local split, as every rank
            view = checkpoint_view(dt)
            local = dt.to_local()
            items = view.__create_write_items__("w", view)
            assert all(tuple(i.tensor_data.size) == tuple(full.shape) for i in items)
            for item in items:
                chunk = item.tensor_data.chunk
                piece = view.__get_tensor_shard__(item.index)
                block = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                assert torch.equal(piece, full[block]), (name, rank, chunk)
                assert piece.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
                covered[block] += 1
            pieces_per_rank.append(len(items))
            dist.destroy_process_group()
        result[name] = {"pieces": pieces_per_rank, "min_cover": covered.min().item(),
                        "max_cover": covered.max().item()}
    return result


def main():
    warnings.filterwarnings("ignore")
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "fake":
        (out / "fake.json").write_text(json.dumps(_fake()))
        return
    import torch.distributed as dist

    import ultrascale_plugins as us
    from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint

    us.init_distributed(timeout=120)
    batches = padded_batches(STEPS)
    result = {}
    if mode == "tp2":
        tp2 = {"tp": 2, "dp_shard": 1}
        pmodel, opt = _build(tp2)
        result["packed"] = _packed_params(pmodel)
        first = train_steps(pmodel, opt, range(SAVE_AT), batches)
        ckpt = save_checkpoint(pmodel, opt, out / "tp2", step=SAVE_AT)
        saved = pmodel.full_state_dict()
        if dist.get_rank() == 0:
            torch.save(saved, out / "saved_full.pt")
        result["uninterrupted"] = first + train_steps(pmodel, opt, range(SAVE_AT, STEPS), batches)
        r = _resume(tp2, ckpt, saved, batches)
        result["tp2"] = {"weight_diff": r["weight_diff"], "losses": r["losses"]}
        # ZeRO-3 without TP, then from there back into tp=2: the read path of the packed shards
        z3 = _resume({"dp_shard": 2}, ckpt, saved, batches)
        result["dp2"] = {"weight_diff": z3["weight_diff"], "losses": z3["losses"]}
        pmodel, opt = _build({"dp_shard": 2}, seed=7)
        load_checkpoint(pmodel, opt, ckpt)
        ckpt_dp2 = save_checkpoint(pmodel, opt, out / "dp2", step=SAVE_AT)
        r = _resume(tp2, ckpt_dp2, saved, batches)
        result["dp2_to_tp2"] = {"weight_diff": r["weight_diff"], "losses": r["losses"]}
    elif mode == "tp1":
        saved = torch.load(out / "saved_full.pt", weights_only=True)
        r = _resume({}, out / "tp2" / f"step-{SAVE_AT:08d}", saved, batches)
        result["tp1"] = {"weight_diff": r["weight_diff"], "losses": r["losses"]}
    if dist.get_rank() == 0:
        (out / f"{mode}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ---- tests -------------------------------------------------------------------------------------------------
def test_packed_shards_are_described_as_their_pieces_of_the_global_tensor(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, __file__, "fake", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "fake.json").read_text())
    # every element of the global tensor written exactly once, by pieces of gate and of up
    for name, case in r.items():
        assert (case["min_cover"], case["max_cover"]) == (1, 1), (name, case)
    assert r["tp2"]["pieces"] == [2, 2] and r["tp4"]["pieces"] == [2] * 4
    assert r["dp2_tp2"]["pieces"] == [2] * 4


@pytest.fixture(scope="module")
def tp_moe_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("tp_moe")
    proc = torchrun(2, Path(__file__), "tp2", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    proc = torchrun(1, Path(__file__), "tp1", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {**json.loads((tmp_path / "tp2.json").read_text()), **json.loads((tmp_path / "tp1.json").read_text())}


@pytest.mark.slow
def test_tp_moe_checkpoint_loads_the_same_full_weights_in_every_layout(tp_moe_run):
    r = tp_moe_run
    assert any(n.endswith("experts.gate_up_proj") for n in r["packed"]), r["packed"]  # the case under test
    for name in ("tp2", "dp2", "tp1", "dp2_to_tp2"):
        assert r[name]["weight_diff"] == 0.0, (name, r[name])


@pytest.mark.slow
def test_tp_moe_resume_continues_the_uninterrupted_run(tp_moe_run):
    r = tp_moe_run
    expected = r["uninterrupted"][SAVE_AT:]
    assert r["tp2"]["losses"] == expected  # same layout: bit for bit
    # other layouts sum in another order: the optimizer states of the packed weight must have come back right
    for name in ("dp2", "tp1", "dp2_to_tp2"):
        assert max(abs(a - b) for a, b in zip(r[name]["losses"], expected)) <= 1e-5, (name, r[name], expected)


if __name__ == "__main__":
    main()

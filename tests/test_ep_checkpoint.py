"""Checkpoints under expert parallelism: every experts parameter (``mlp.experts.gate_up_proj``, [experts, 2I, H]) is a
DTensor sharded by expert over the ``ep`` axis of the "experts" mesh view, then by FSDP2 over ``efsdp``
(``(_StridedShard(0, sf=ep), Shard(0))`` on (efsdp, ep)). The checkpoint must hold the plain global tensors (and the
optimizer states alike), so that it resumes at another ep, without EP and with the experts sharded by TP instead;
``ultrascale export`` must write transformers' per-expert format; ``--init-from`` must give each rank its own experts
reading only those; and a meta-device model must be initialized as in one process.

This file is also the worker (``python -m torch.distributed.run --nproc_per_node 4 tests/test_ep_checkpoint.py OUT``,
one launch for every case):

- train {dp_shard: 4, ep: 4} to step SAVE_AT, save, continue to STEPS (the uninterrupted run); resume the checkpoint
  in each of RESUME and continue to STEPS; save from {dp_shard: 4} (for the export without EP) and from
  {dp_shard: 4, ep: 2} (efsdp = 2: strided shards written), and load the latter into {dp_shard: 4, ep: 4} again;
- ``from_pretrained`` of a per-expert ``save_pretrained`` directory (several files) into PRETRAINED, recording every
  tensor element read from the files on each rank;
- ``parallelize`` of a meta-device model in PRETRAINED, against ``ModelInit`` in one process (tests/test_init.py).

The exports run in the pytest process (one process, no group), as does a one-process export of a Mixtral model
(another naming of the per-expert tensors, tied embeddings).
"""
import json
import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import torchrun  # noqa: E402
from models import make_config, make_model, padded_batches, train_steps  # noqa: E402
import ultrascale_plugins as us  # noqa: E402

ARCH = "qwen3_moe"  # 8 experts, top-2, 2 layers (tests/models.py)
STEPS, SAVE_AT, SEED = 4, 2, 1234
EP4 = {"dp_shard": 4, "ep": 4}
RESUME = {"ep4": EP4, "ep2": {"dp_shard": 4, "ep": 2}, "no_ep": {"dp_shard": 4},
          "tp2_experts": {"dp_shard": 2, "tp": 2}}  # ep = 1: the experts' fused gate|up is TP-packed
PRETRAINED = {"ep4": EP4, "ep2": {"dp_shard": 4, "ep": 2},
              "ep2_hsdp": {"dp_replicate": 2, "dp_shard": 2, "ep": 2}}  # the experts replicated over dp_replicate
EXPERTS = "mlp.experts."


# ---- worker ------------------------------------------------------------------------------------------------
def _build(layout: dict, seed: int = 0):
    import ultrascale_plugins as us

    pmodel = us.parallelize(make_model(ARCH, seed), us.ParallelConfig(**layout))
    return pmodel, pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _expert_placements(pmodel) -> dict:
    p = pmodel.module.get_parameter(f"model.layers.0.{EXPERTS}gate_up_proj")
    return {"placements": [f"{type(x).__name__}({getattr(x, 'dim', '')})" for x in getattr(p, "placements", [])],
            "mesh": list(getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or []),
            "local_shape": list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape)}


def _degrees(param) -> tuple[int, int]:
    mesh = param.device_mesh
    return mesh.size(mesh.mesh_dim_names.index("ep")), mesh.size(mesh.mesh_dim_names.index("efsdp"))


def _own_rows(param) -> list[int]:
    """The experts this rank must hold, from its mesh coordinates alone: its ep block of the experts, then its
    efsdp part of that block."""
    mesh = param.device_mesh
    ep, efsdp = _degrees(param)
    block = param.shape[0] // ep
    rows = list(range(mesh.get_local_rank("ep") * block, (mesh.get_local_rank("ep") + 1) * block))
    part = block // efsdp
    return rows[mesh.get_local_rank("efsdp") * part:(mesh.get_local_rank("efsdp") + 1) * part]


class _Recorded:
    """``safetensors.safe_open`` that records (key, elements) of every tensor read (not headers or shapes)."""

    reads: list = []

    def __init__(self, opened):
        self._f = opened

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def get_tensor(self, key):
        tensor = self._f.get_tensor(key)
        self.reads.append((key, tensor.numel()))
        return tensor

    def get_slice(self, key):
        return _RecordedSlice(key, self._f.get_slice(key), self.reads)


class _RecordedSlice:
    def __init__(self, key, piece, reads):
        self._key, self._s, self._reads = key, piece, reads

    def __getattr__(self, name):
        return getattr(self._s, name)

    def __getitem__(self, index):
        tensor = self._s[index]
        self._reads.append((self._key, tensor.numel()))
        return tensor


def _pretrained(out: Path) -> dict:
    """``from_pretrained`` into each PRETRAINED layout: the weights, each rank's own experts, what it read."""
    import safetensors
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import ultrascale_plugins as us
    from ultrascale_plugins.checkpoints import read_plan

    path = out / "hf"
    if dist.get_rank() == 0:  # the per-expert format, over several files
        make_model(ARCH, seed=3).save_pretrained(path, max_shard_size="100KB")
    dist.barrier()
    ref = AutoModelForCausalLM.from_pretrained(path).state_dict()
    found = read_plan.file_tensors(path)
    expert_keys = [k for k in found if EXPERTS in k]
    result = {"files": len({f for _, f in found.values()}), "expert_keys": len(expert_keys),
              "expert_elements": sum(torch.Size(found[k][0]).numel() for k in expert_keys)}
    real_open = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _Recorded(real_open(*a, **k))
    try:
        for name, layout in PRETRAINED.items():
            _Recorded.reads.clear()
            pmodel = us.from_pretrained(path, us.ParallelConfig(**layout))
            reads = list(_Recorded.reads)
            own, exact = {}, True
            for fqn, p in pmodel.module.named_parameters():
                if EXPERTS in fqn:
                    rows = _own_rows(p)
                    own[fqn] = rows
                    exact = exact and torch.equal(p.to_local().cpu(), ref[fqn][rows])
            mine = {
                "rows": sorted({r for rows in own.values() for r in rows}),
                "exact": exact,
                "expert_ids_read": sorted({int(k.split(EXPERTS)[1].split(".")[0]) for k, _ in reads if EXPERTS in k}),
                "expert_elements_read": sum(n for k, n in reads if EXPERTS in k),
                "expert_keys_read": len([k for k, _ in reads if EXPERTS in k]),
                "distinct_expert_keys_read": len({k for k, _ in reads if EXPERTS in k}),
            }
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            full = pmodel.full_state_dict()
            ep, efsdp = _degrees(pmodel.module.get_parameter(f"model.layers.0.{EXPERTS}down_proj"))
            result[name] = {"weight_diff": _diff(full, ref), "ranks": gathered, "ep": ep, "efsdp": efsdp,
                            "placements": _expert_placements(pmodel)}
    finally:
        safetensors.safe_open = real_open
    return result


def _meta_init() -> dict:
    """A meta-device model parallelized in each PRETRAINED layout gets the weights ModelInit gives in one process."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import ultrascale_plugins as us
    from ultrascale_plugins.core.initialize import ModelInit
    from ultrascale_plugins.checkpoints.load import weights_for

    def meta_model():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(make_config(ARCH), attn_implementation="sdpa")

    ref = meta_model()  # what the engine does in one process (tests/test_init.py's init_in_process)
    ModelInit(ref, seed=SEED, pm=us.get_plugin_manager()).load(types.SimpleNamespace(modules=[ref], device=torch.device("cpu")), {})
    ref_state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    result = {}
    for name, layout in PRETRAINED.items():
        torch.manual_seed(SEED)  # as the CLI does: the initializer takes torch.initial_seed()
        model = meta_model()
        pmodel = us.parallelize(model, us.ParallelConfig(**layout), init_weights=weights_for(model, None))
        full = pmodel.full_state_dict()
        if dist.get_rank() == 0:
            result[name] = {"differing": sorted(k for k in ref_state if not torch.equal(full[k], ref_state[k])),
                            "keys_equal": set(full) == set(ref_state),
                            "placements": _expert_placements(pmodel)}
    return result


def main():
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = Path(sys.argv[1])
    import torch.distributed as dist

    import ultrascale_plugins as us
    from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint

    us.init_distributed(timeout=120)
    rank0 = dist.get_rank() == 0
    batches = padded_batches(STEPS)
    result = {}

    def log(what):
        print(f"[ep_checkpoint] {what} (rank {dist.get_rank()})", file=sys.stderr, flush=True)

    log("train and save at ep=4")
    pmodel, opt = _build(EP4)
    result["saved_placements"] = _expert_placements(pmodel)
    first = train_steps(pmodel, opt, range(SAVE_AT), batches)
    ckpt = save_checkpoint(pmodel, opt, out / "ep4", step=SAVE_AT)
    saved = pmodel.full_state_dict()
    if rank0:
        torch.save(saved, out / "saved_full.pt")
    result["uninterrupted"] = first + train_steps(pmodel, opt, range(SAVE_AT, STEPS), batches)
    final = pmodel.full_state_dict()
    del pmodel, opt
    for name, layout in RESUME.items():
        log(f"resume in {name}")
        pmodel, opt = _build(layout, seed=7)  # other initial weights: everything must come from the checkpoint
        meta = load_checkpoint(pmodel, opt, ckpt)
        assert meta["step"] == SAVE_AT
        r = {"weight_diff": _diff(pmodel.full_state_dict(), saved), "placements": _expert_placements(pmodel)}
        if name in ("no_ep", "ep2"):  # saved again from this layout, before training on
            save_checkpoint(pmodel, opt, out / name, step=SAVE_AT)
        r["losses"] = train_steps(pmodel, opt, range(SAVE_AT, STEPS), batches)
        r["final_diff"] = _diff(pmodel.full_state_dict(), final)
        result[name] = r
        del pmodel, opt
    log("ep=2 (efsdp=2) checkpoint into ep=4")
    pmodel, opt = _build(EP4, seed=7)
    load_checkpoint(pmodel, opt, out / "ep2" / f"step-{SAVE_AT:08d}")
    result["ep2_to_ep4"] = {"weight_diff": _diff(pmodel.full_state_dict(), saved),
                            "losses": train_steps(pmodel, opt, range(SAVE_AT, STEPS), batches)}
    del pmodel, opt
    log("control: the model's state alone, without the optimizer's")  # the final weights tell them apart
    pmodel, opt = _build(RESUME["ep2"], seed=7)
    load_checkpoint(pmodel, None, ckpt)
    train_steps(pmodel, opt, range(SAVE_AT, STEPS), batches)
    result["control_without_optimizer_state"] = {"final_diff": _diff(pmodel.full_state_dict(), final)}
    del pmodel, opt
    log("from_pretrained")
    result["pretrained"] = _pretrained(out)
    log("meta-device init")
    result["meta_init"] = _meta_init()
    if rank0:
        (out / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ---- tests -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_ckpt")
    proc = torchrun(4, Path(__file__), str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return out, json.loads((out / "result.json").read_text())


def _checkpoint(out: Path, name: str) -> Path:
    return out / name / f"step-{SAVE_AT:08d}"


@pytest.mark.slow
def test_ep_checkpoint_holds_whole_experts(ep_run):
    from ultrascale_plugins.checkpoints.sharded import SafeReader

    out, r = ep_run
    # the case under test: experts sharded by ep=4 on the experts view (efsdp x ep), FSDP's strided shard over efsdp
    assert r["saved_placements"]["mesh"] == ["efsdp", "ep"], r["saved_placements"]
    assert r["saved_placements"]["local_shape"][0] == 2
    md = SafeReader(str(_checkpoint(out, "ep4"))).read_metadata().state_dict_metadata
    param = f"model.layers.1.{EXPERTS}gate_up_proj"
    for key in (f"model.{param}", f"optim.{param}.exp_avg", f"optim.{param}.exp_avg_sq"):
        entry = md[key]
        assert tuple(entry.size) == (8, 64, 64), key  # the global tensor, every expert
        # the four ranks' chunks tile the experts dim, each whole along the others
        rows = sorted((c.offsets[0], c.sizes[0]) for c in entry.chunks)
        assert rows == [(0, 2), (2, 2), (4, 2), (6, 2)], (key, rows)
        assert all(tuple(c.sizes[1:]) == (64, 64) for c in entry.chunks), key


@pytest.mark.slow
def test_ep_checkpoint_resumes_at_another_ep_without_ep_and_with_tp_experts(ep_run):
    _, r = ep_run
    expected = r["uninterrupted"][SAVE_AT:]
    assert r["ep2"]["placements"]["mesh"] == ["efsdp", "ep"]
    assert r["ep2"]["placements"]["placements"] == ["_StridedShard(0)", "Shard(0)"]  # efsdp = 2: strided shards
    assert r["no_ep"]["placements"]["mesh"] == ["dp_shard"]
    assert r["tp2_experts"]["placements"]["mesh"] == ["dp_shard", "tp"]  # the experts sharded by TP instead
    assert r["tp2_experts"]["placements"]["placements"][1] == "_StridedShard(1)"  # packed gate|up rows
    for name in (*RESUME, "ep2_to_ep4"):
        assert r[name]["weight_diff"] == 0.0, (name, r[name])  # the full state is what was saved, exactly
        assert max(abs(a - b) for a, b in zip(r[name]["losses"], expected)) <= 1e-5, (name, r[name], expected)
    for name in RESUME:  # and the weights after the continued steps are the uninterrupted run's
        assert r[name]["final_diff"] <= 1e-5, (name, r[name])
    # ... which they would not be had the optimizer's states (AdamW's moments and step) not come back
    assert r["control_without_optimizer_state"]["final_diff"] > 1e-4, r["control_without_optimizer_state"]


@pytest.mark.slow
def test_export_writes_transformers_per_expert_format(ep_run, tmp_path):
    """`ultrascale export` of a checkpoint saved at ep=4 and of one saved without EP: the keys transformers' own
    save_pretrained writes for the model (one tensor per expert and projection), loading with plain
    from_pretrained to the saved weights exactly."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.cli.main import main as ultrascale

    out, _ = ep_run
    saved = torch.load(out / "saved_full.pt", weights_only=True)
    make_model(ARCH).save_pretrained(tmp_path / "plain")
    with safe_open(str(tmp_path / "plain" / "model.safetensors"), framework="pt") as f:
        plain_keys = set(f.keys())
    assert f"model.layers.0.{EXPERTS}7.gate_proj.weight" in plain_keys  # what transformers writes
    for name in ("ep4", "no_ep"):
        hf = tmp_path / f"hf-{name}"  # `ultrascale export`, in this process; several files
        assert ultrascale(["export", str(_checkpoint(out, name)), str(hf), "--max-shard-gb", str(150_000 / 2**30)]) == 0
        index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(index) == plain_keys, (name, sorted(set(index) ^ plain_keys)[:6])
        loaded = AutoModelForCausalLM.from_pretrained(hf).state_dict()
        assert set(loaded) == set(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (name, key)


def test_export_of_another_moe_naming_is_what_save_pretrained_writes(tmp_path):
    """Mixtral's experts (``block_sparse_moe.experts.<e>.w1/w2/w3``, fused as gate_up_proj / down_proj), tied
    embeddings: exported from a one-process checkpoint under the names transformers' save_pretrained writes."""
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    import ultrascale_plugins as us
    from ultrascale_plugins.checkpoints.sharded import save_checkpoint
    from ultrascale_plugins.checkpoints.export import export_hf

    config = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                  num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "plain")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        ckpt = save_checkpoint(us.parallelize(model, us.ParallelConfig()), None, tmp_path / "ckpt", step=1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    hf = export_hf(ckpt, tmp_path / "hf")
    keys = {}
    for name in ("plain", "hf"):
        with safe_open(str(tmp_path / name / "model.safetensors"), framework="pt") as f:
            keys[name] = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in keys["plain"]  # transformers' own per-expert names
    assert keys["hf"] == keys["plain"], sorted(keys["hf"] ^ keys["plain"])[:6]
    loaded = AutoModelForCausalLM.from_pretrained(hf).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.slow
def test_init_from_gives_each_rank_its_own_experts_reading_only_those(ep_run):
    _, r = ep_run
    p = r["pretrained"]
    assert p["files"] > 1 and p["expert_keys"] == 2 * 8 * 3  # per expert: gate, up, down, over several files
    for name in PRETRAINED:
        case = p[name]
        assert case["weight_diff"] == 0.0, (name, case)
        assert case["placements"]["mesh"][-2:] == ["efsdp", "ep"], case["placements"]
        held = [rank["rows"] for rank in case["ranks"]]
        replicas = len(held) // (case["ep"] * case["efsdp"])  # HSDP: once per replica
        assert sorted(e for rows in held for e in rows) == sorted(list(range(8)) * replicas), held
        for rank, mine in enumerate(case["ranks"]):
            assert mine["exact"], (name, rank)  # its local experts are exactly the full tensors' rows
            assert mine["expert_ids_read"] == mine["rows"], (name, rank, mine)  # no other rank's expert was read
            # each expert tensor once, and exactly this rank's part: 1/(ep*efsdp) of the experts' elements
            assert mine["expert_keys_read"] == mine["distinct_expert_keys_read"], (name, rank, mine)
            share = case["ep"] * case["efsdp"]
            assert mine["expert_elements_read"] * share == p["expert_elements"], (name, rank, mine, share)


@pytest.mark.slow
def test_meta_device_model_under_ep_is_initialized_as_in_one_process(ep_run):
    _, r = ep_run
    for name in PRETRAINED:
        assert r["meta_init"][name]["keys_equal"], name
        assert r["meta_init"][name]["differing"] == [], (name, r["meta_init"][name])
        assert r["meta_init"][name]["placements"]["mesh"][-2:] == ["efsdp", "ep"]


if __name__ == "__main__":
    main()

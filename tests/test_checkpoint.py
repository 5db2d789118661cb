"""Sharded checkpoints: exact resume, resharding across layouts and world sizes, crash safety, safe loading,
checksums."""
import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ultrascale_plugins as us
from conftest import torchrun
from models import make_model, padded_batches
from ultrascale_plugins.checkpoints.errors import CheckpointError
from ultrascale_plugins.checkpoints.sharded import list_checkpoints, load_checkpoint, read_meta, save_checkpoint

WORKER = Path(__file__).parent / "checkpoint_worker.py"


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """One 4-rank launch that saves and resumes across layouts (and loads pretrained weights into several), one
    2-rank launch that resumes its checkpoint."""
    tmp_path = tmp_path_factory.mktemp("sharded")
    proc = torchrun(4, WORKER, "save_and_reshard", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    proc = torchrun(2, WORKER, "reshard_world", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return tmp_path


@pytest.mark.slow
def test_resume_is_exact_and_reshards_across_layouts_and_world_sizes(sharded_run):
    tmp_path = sharded_run
    r = {**json.loads((tmp_path / "save_and_reshard.json").read_text()),
         **json.loads((tmp_path / "reshard_world.json").read_text())}
    expected = r["uninterrupted"][3:]
    assert r["same_layout"] == expected  # bit for bit
    # written in the background while training went on: invisible until committed, then resumes bit for bit
    assert r["async_hidden_until_committed"]
    assert r["async_same_layout"] == r["async_uninterrupted"][3:]
    # ZeRO-1 (partitioned optimizer state) resumes within 1e-7, not bit for bit: DDP rebuilds its gradient
    # buckets after a process's first step, so the resumed run's first all-reduces sum in another order
    assert r["zero1_same_layout"] == pytest.approx(r["zero1_uninterrupted"][3:], abs=1e-6, rel=0)
    for name in ("tp2_dp2_sp", "pp2_tp2_to_dp4", "dp4_to_pp2_zbv_dp2", "tp2_from_4_ranks", "dp4_to_zero1",
                 "zero1_to_tp2_dp2", "dp4_to_cp2_tp2_sp", "dp4_to_cp2_ulysses_dp2", "dp4_to_zero1_tp2",
                 "zero1_tp2_to_dp4"):
        assert max(abs(a - b) for a, b in zip(r[name], expected)) <= 1e-5, (name, r[name], expected)


def crc32(path: Path) -> str:
    return f"{zlib.crc32(path.read_bytes()):08x}"


def assert_checksums_match(ckpt: Path) -> None:
    """Every file the checkpoint lists has the CRC-32 its ultrascale.json records (computed here independently)."""
    meta = json.loads((ckpt / "ultrascale.json").read_text())
    assert meta["checksums"]["algorithm"] == "crc32"
    assert set(meta["checksums"]["files"]) == set(meta["files"]) and meta["files"], ckpt
    for name, digest in meta["checksums"]["files"].items():
        assert crc32(ckpt / name) == digest, (ckpt, name)


@pytest.mark.slow
def test_checksums_each_rank_hashes_its_own_files_and_verifies_a_share(sharded_run):
    """4 ranks: every checkpoint written (blocking, in the background, PP x TP, ZeRO-1) records a checksum per file
    that matches it; at save each rank hashed only the files it wrote; at load each file was verified by exactly one
    rank (a rank's shard by that rank); flipped bytes in rank 2's shard are refused on every rank, naming it."""
    for ckpt in ("dp4", "async", "pp2tp2", "zero1"):
        assert_checksums_match(sharded_run / ckpt / "step-00000003")
    every = json.loads((sharded_run / "save_and_reshard.json").read_text())["checksums"]
    names = set(json.loads((sharded_run / "checksums" / "step-00000001" / "ultrascale.json").read_text())["files"])
    for rank, r in enumerate(every):
        own = {f"__{rank}_0.distcp", f"rank_local/rank{rank:05d}.pt"} | ({".metadata"} if rank == 0 else set())
        assert set(r["saved"]) == own, (rank, r["saved"])
        assert f"__{rank}_0.distcp" in r["verified"], (rank, r["verified"])
        assert "__2_0.distcp" in r["refused"] and "corrupted" in r["refused"], r["refused"]
    verified = [name for r in every for name in r["verified"]]
    assert sorted(verified) == sorted(names)  # each file once, by one rank: no rank re-reads another's share
    assert len({r["refused"] for r in every}) == 1  # every rank refuses with the same line


@pytest.mark.slow
def test_pretrained_weights_load_into_every_layout_from_the_meta_device(sharded_run):
    from checkpoint_worker import PRETRAINED_LAYOUTS

    r = json.loads((sharded_run / "save_and_reshard.json").read_text())["pretrained"]
    assert r["files"] > 1  # a sharded save_pretrained directory
    for name, layout in PRETRAINED_LAYOUTS.items():
        assert r[name]["keys_equal"], name
        assert r[name]["weight_diff"] == 0.0, (name, r[name])
        assert r[name]["loss_diff"] <= 1e-5, (name, r[name])
        if layout.get("pp", 1) == 1:
            assert r[name]["logits_diff"] <= 1e-5, (name, r[name])


@pytest.fixture
def one_process():
    pmodel = us.parallelize(make_model("llama"), us.ParallelConfig())
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3)
    for batch in padded_batches(2):
        pmodel.train_step(batch)
        opt.step()
        opt.zero_grad()
    yield pmodel, opt
    dist.destroy_process_group()


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, one_process, monkeypatch):
    pmodel, opt = one_process
    good = save_checkpoint(pmodel, opt, tmp_path, step=1)
    before = {k: v.clone() for k, v in pmodel.full_state_dict().items()}
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def crash(state, **kwargs):
        real_save(state, **kwargs)  # shards written, then the job dies before committing
        raise RuntimeError("killed during save")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(RuntimeError, match="killed during save"):
        save_checkpoint(pmodel, opt, tmp_path, step=2)
    monkeypatch.undo()
    assert list_checkpoints(tmp_path) == [good]  # the partial one is invisible
    for p in pmodel.parameters():
        p.data.add_(1.0)
    meta = load_checkpoint(pmodel, opt, directory=tmp_path)
    assert meta["step"] == 1
    after = pmodel.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_keep_last_n_never_deletes_the_newest(tmp_path, one_process):
    pmodel, opt = one_process
    for step in (1, 2, 3):
        save_checkpoint(pmodel, opt, tmp_path, step=step, keep_last_n=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    save_checkpoint(pmodel, opt, tmp_path, step=4, keep_last_n=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004"]


def test_truncated_or_incomplete_checkpoint_is_named(tmp_path, one_process):
    pmodel, opt = one_process
    path = save_checkpoint(pmodel, opt, tmp_path, step=1)
    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated"):
        load_checkpoint(pmodel, opt, path)
    (path / "ultrascale.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        read_meta(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_meta(tmp_path / "nope")


def test_loading_never_unpickles_objects(tmp_path, one_process):
    pmodel, opt = one_process
    path = save_checkpoint(pmodel, opt, tmp_path, step=1)

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    rng_file = path / "rank_local" / "rank00000.pt"
    rng_file.write_bytes(pickle.dumps({"cpu": Boom()}))
    with pytest.raises(CheckpointError, match="rank00000.pt"):  # the size check notices first
        load_checkpoint(pmodel, opt, path)
    meta = json.loads((path / "ultrascale.json").read_text())
    meta["files"]["rank_local/rank00000.pt"] = rng_file.stat().st_size  # a forger who also edits the sizes
    (path / "ultrascale.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="rank00000.pt' is corrupted"):  # the checksum notices then
        load_checkpoint(pmodel, opt, path)
    meta["checksums"]["files"]["rank_local/rank00000.pt"] = crc32(rng_file)  # ... and the checksums
    (path / "ultrascale.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="could not be read safely"):  # refused, never executed
        load_checkpoint(pmodel, opt, path)


def test_export_from_one_process_gives_equal_logits(tmp_path, one_process):
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.checkpoints.export import export_hf

    pmodel, opt = one_process
    path = save_checkpoint(pmodel, opt, tmp_path / "ckpt", step=2)
    out = export_hf(path, tmp_path / "hf", max_shard_bytes=100_000)  # several shards + index
    assert (out / "model.safetensors.index.json").is_file() and (out / "generation_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = padded_batches(1)[0]["input_ids"]
    pmodel.module.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, pmodel.module(ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(CheckpointError, match="not empty"):
        export_hf(path, out)


@pytest.mark.slow
def test_export_of_sharded_checkpoints_matches_one_process_training(sharded_run, tmp_path):
    """Checkpoints written by 4 ranks as ZeRO-3 and as PP x TP export to the weights one process trains."""
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.checkpoints.export import export_hf

    ref = make_model("llama8_tied")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for batch in padded_batches(6)[:3]:
        ref(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    ids = padded_batches(1)[0]["input_ids"]
    with torch.no_grad():
        expected = ref.eval()(ids).logits
        # AdamW divides by the running gradient norm, which magnifies the last-bit differences of another
        # reduction order: three steps as PP x TP land ~1.5e-5 from one process, ZeRO-3 within 1e-5. The export
        # itself is exact (see the one-process test above).
        for layout, tol in (("dp4", 1e-5), ("pp2tp2", 5e-5)):
            out = export_hf(sharded_run / layout / "step-00000003", tmp_path / f"hf-{layout}")
            got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
            assert (got - expected).abs().max() <= tol, layout


def test_plugins_save_and_restore_their_own_state(tmp_path, one_process):
    pmodel, opt = one_process

    class Counter:
        def __init__(self):
            self.seen = torch.tensor([0.0])
            self.name = "start"

        @us.hookimpl
        def ultrascale_state_save(self, pmodel, state):
            state.shared["counter.seen"] = self.seen
            state.shared["counter.name"] = self.name
            state.rank_local["counter.rank"] = torch.tensor([7.0])

        @us.hookimpl
        def ultrascale_state_load(self, pmodel, state):
            self.seen.copy_(state.shared["counter.seen"])
            self.name = state.shared["counter.name"]
            self.rank = state.rank_local["counter.rank"]

    counter = Counter()
    us.register(counter, name="counter")
    try:
        counter.seen.fill_(41.0)
        counter.name = "after step 1"
        path = save_checkpoint(pmodel, opt, tmp_path, step=1)
        counter.seen.fill_(0.0)
        counter.name = "changed"
        load_checkpoint(pmodel, opt, path)
        assert counter.seen.item() == 41.0 and counter.name == "after step 1" and counter.rank.item() == 7.0
    finally:
        us.unregister(name="counter")


def test_a_hugging_face_directory_is_not_taken_for_a_broken_checkpoint(tmp_path):
    from ultrascale_plugins.checkpoints.errors import CheckpointError
    from ultrascale_plugins.checkpoints.sharded import read_meta

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="Hugging Face model directory.*--init-from"):
        read_meta(tmp_path)


def flip_bytes(shard: Path, count: int = 4000) -> None:
    """``count`` bytes inverted in the middle of ``shard``: the same size, other contents."""
    data = bytearray(shard.read_bytes())
    start = len(data) // 2 - count // 2
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    shard.write_bytes(data)


def test_flipped_bytes_in_a_shard_are_refused_by_load_and_export(tmp_path, one_process):
    """The issue's corruption (bytes flipped inside a shard, same size) resumed silently: now load_checkpoint, the
    load every front end goes through (Accelerate's load_state, Lightning's load_checkpoint, Trainer's resume and
    best model), and export refuse it naming the file, before anything is loaded or written."""
    from ultrascale_plugins.checkpoints.export import export_hf

    pmodel, opt = one_process
    path = save_checkpoint(pmodel, opt, tmp_path / "ckpt", step=1)
    assert_checksums_match(path)
    before = {k: v.clone() for k, v in pmodel.full_state_dict().items()}
    shard = next(path.glob("*.distcp"))
    flip_bytes(shard)
    with pytest.raises(CheckpointError, match=f"'{shard.name}' is corrupted.*Fix:"):
        load_checkpoint(pmodel, opt, path)
    after = pmodel.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # nothing was loaded
    with pytest.raises(CheckpointError, match=f"'{shard.name}' is corrupted"):
        export_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_checkpoints_without_checksums_load_with_a_note(tmp_path, one_process, capsys, monkeypatch):
    """A checkpoint written before checksums (no "checksums" in ultrascale.json) still loads, saying once that its
    contents were not verified; ULTRASCALE_SKIP_CHECKSUMS=1 skips the verification (no file is hashed), saying so
    too."""
    from ultrascale_plugins.checkpoints import checksums

    pmodel, opt = one_process
    path = save_checkpoint(pmodel, opt, tmp_path, step=1)
    meta = json.loads((path / "ultrascale.json").read_text())
    del meta["checksums"]
    (path / "ultrascale.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert load_checkpoint(pmodel, opt, path)["step"] == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "written before checkpoints carried checksums" in out[0], out
    path = save_checkpoint(pmodel, opt, tmp_path, step=2)
    monkeypatch.setenv("ULTRASCALE_SKIP_CHECKSUMS", "1")
    monkeypatch.setattr(checksums, "file_digest", lambda p: pytest.fail(f"{p} was hashed"))
    capsys.readouterr()
    assert load_checkpoint(pmodel, opt, path)["step"] == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "not verified (ULTRASCALE_SKIP_CHECKSUMS=1)" in out[0], out


def test_what_dcp_refuses_is_one_line_naming_the_tensor(tmp_path, one_process):
    """DCP's own refusals (a CheckpointException, which is not an Exception) escaped every front end's error
    handling as a traceback listing each rank's; now they are the CheckpointError of the first failing rank."""
    pmodel, opt = one_process
    path = save_checkpoint(pmodel, opt, tmp_path, step=1)
    emb = pmodel.module.get_input_embeddings()
    emb.weight.data = torch.zeros(emb.weight.shape[0] + 1, emb.weight.shape[1])  # a model of another shape
    with pytest.raises(CheckpointError, match=r"could not be read: Size mismatch .*embed_tokens\.weight") as info:
        load_checkpoint(pmodel, None, path)
    assert "\n" not in str(info.value)


def ultrascale(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line(proc, *words):
    """Exit status 2 and one line on standard error, no traceback (as the command line refuses bad input)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ultrascale: error:"), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_a_malformed_ultrascale_json_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """It was a 24-line JSONDecodeError traceback and exit 1; now `ultrascale train --resume` (before any worker
    starts) and `ultrascale export` refuse it in one line, with exit 2."""
    from ultrascale_plugins.cli import main as cli

    monkeypatch.setattr(cli.Supervisor, "run", lambda *a, **k: pytest.fail(f"a worker was started: {a}"))
    ckpt = tmp_path / "ckpt" / "step-00000001"
    ckpt.mkdir(parents=True)
    for text, argv, words in (
            ('{"format": 1, "step": 1,', ["train", "--resume", str(tmp_path / "ckpt")], ["not valid JSON"]),
            ('{"format": 1, "step": "one", "world_size": 1}', ["export", str(ckpt), str(tmp_path / "hf")],
             ["is malformed", "'step'"])):
        (ckpt / "ultrascale.json").write_text(text)
        capsys.readouterr()
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ultrascale: error:"), err
        for word in [str(ckpt), "ultrascale.json", "Fix:", *words]:
            assert word in err[0], err[0]


@pytest.mark.slow
def test_a_corrupted_shard_is_refused_by_resume_from_the_command_line(tmp_path):
    """A run saving in the background (train.async_save) writes checksums that match its files; bytes flipped
    inside the shard (same size) are then refused by `ultrascale train --resume` (found by the worker that verifies
    that shard, said once by the command line) in one line with exit 2. (Export: tested above, in this process.)"""
    one = ["--nproc", "1", "--set", "pp=1", "--set", "tp=1", "--set", "dp_shard=1", "--set", "sequence_parallel=false",
           "--set", "train.steps=1", "--set", f"train.save_dir={tmp_path / 'ckpt'}", "--set", "train.async_save=true"]
    proc = ultrascale("train", *one)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = tmp_path / "ckpt" / "step-00000001"
    assert_checksums_match(ckpt)
    shard = next(ckpt.glob("*.distcp"))
    flip_bytes(shard)
    proc = ultrascale("train", *one, "--resume", str(ckpt))
    assert_one_line(proc, str(ckpt), shard.name, "corrupted", "Fix:")
    assert "resumed from" not in proc.stdout

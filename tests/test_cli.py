"""The ``ultrascale`` command: the embedded default trains; bad input is one clear line and exit code 2."""
import json
import subprocess
import sys

import pytest


def ultrascale(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_clean_error(proc, *words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ultrascale: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0]


def test_missing_recipe(tmp_path):
    assert_clean_error(ultrascale("train", str(tmp_path / "nope.yaml")), "nope.yaml", "does not exist")


def test_bad_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert_clean_error(ultrascale("train", str(bad)), "not valid YAML")


def test_invalid_layout_is_refused_before_launch():
    assert_clean_error(ultrascale("train", "--nproc", "3", "--set", "tp=3", "--set", "dp_shard=1", "--set", "pp=1"),
                       "tp=3",
                       "num_attention_heads=4")
    assert_clean_error(ultrascale("train", "--set", "tp=two"), "tp='two'", "integer")
    assert_clean_error(ultrascale("train", "--nproc", "3"), "world size is 3")
    # the embedded default already fills its 8 processes (pp=2 x dp_shard=2 x tp=2): cp=2 gets a one-line fix
    assert_clean_error(ultrascale("train", "--set", "cp=2"), "cp", "world size is 8", "dp_shard: -1")


def test_unknown_recipe_key_suggests(tmp_path):
    assert_clean_error(ultrascale("train", "--set", "train.stepz=3"), "train.stepz", "did you mean 'steps'")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("nproc: 1\nmodle: {}\n")
    assert_clean_error(ultrascale("train", str(recipe)), "modle", "did you mean 'model'")
    # the model section too (issue 32): a typo beside the real key set nothing and said nothing
    assert_clean_error(ultrascale("train", "--set", "model.hiden_size=64"), "unknown key 'model.hiden_size'",
                       "did you mean 'hidden_size'?", "Fix: hidden_size: 64")


def test_the_final_loss_line_says_what_it_compares():
    """A 2-step run printed "loss 5.337 -> 5.337 (mean of first/last 5 steps)": both means were of the same two
    steps. Each window is now at most half the run, and says how many steps it holds."""
    from ultrascale_plugins.cli.progress import loss_summary

    assert loss_summary([5.337, 5.1]) == "loss 5.337 -> 5.100 (first/last step of 2)"
    assert loss_summary([4.0]) == "loss 4.000 (one step)"
    assert loss_summary([6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5]) == "loss 5.000 -> 1.167 (mean of first/last 3 steps of 7)"
    assert loss_summary([float(i) for i in range(60, 0, -1)]) == ("loss 58.000 -> 3.000 (mean of first/last 5 steps "
                                                                 "of 60)")


def test_plugins_lists_builtins_with_hooks():
    out = ultrascale("plugins")
    assert out.returncode == 0
    assert "ultrascale_plugins.dims.data_parallel.plugin" in out.stdout
    assert "ultrascale_transform_stages" in out.stdout and "field zero_stage: int = 3" in out.stdout


@pytest.mark.slow
def test_embedded_default_trains(tmp_path):
    """The README's first command: 8 CPU processes in 3-D (PP x ZeRO-3 x TP+SP), loss falls, exit 0. (Its run
    time, about 2 minutes on 2 cores, is a benchmark figure in the README, not asserted here.)"""
    metrics = tmp_path / "metrics.json"
    proc = ultrascale("train", "--metrics", str(metrics), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(metrics.read_text())
    assert result["world_size"] == 8
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    assert "pp=2 (1f1b) x dp_shard=2 (ZeRO-3) x tp=2 + sequence parallel" in proc.stdout
    assert "tok/s" in proc.stdout and "peak MB/rank" in proc.stdout


@pytest.mark.slow
def test_bf16_states_stochastic_rounding_and_the_chunked_loss_from_the_command_line(tmp_path):
    """param_dtype: bf16 with torchao's stochastic-rounding AdamW and the chunked loss, under ZeRO-3: it trains."""
    metrics = tmp_path / "metrics.json"
    proc = ultrascale("train", "--nproc", "2", "--set", "pp=1", "--set", "tp=1", "--set", "dp_shard=2",
                      "--set", "sequence_parallel=false", "--set", "param_dtype=bf16", "--set", "chunked_loss=64",
                      "--set", "train.bf16_stochastic_round=true", "--set", "train.steps=8", "--set",
                      "train.log_every=4", "--metrics", str(metrics), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = json.loads(metrics.read_text())["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0], losses


def test_low_bit_states_of_sharded_bf16_weights_are_refused_before_launch():
    proc = ultrascale("train", "--nproc", "2", "--set", "pp=1", "--set", "tp=1", "--set", "dp_shard=2",
                      "--set", "sequence_parallel=false", "--set", "param_dtype=bf16",
                      "--set", "train.optimizer=adamw_8bit")
    assert_clean_error(proc, "train.optimizer=adamw_8bit", "Fix: use parallel.param_dtype: fp32")


@pytest.mark.slow
@pytest.mark.sweep  # benchmarks/sweep_tests.py; every schedule's parity and the embedded default's 1F1B in CI
def test_pipeline_schedule_from_the_command_line(tmp_path):
    metrics = tmp_path / "metrics.json"
    proc = ultrascale("train", "--nproc", "2", "--set", "pp=2", "--set", "tp=1", "--set", "dp_shard=1",
                      "--set", "sequence_parallel=false", "--set", "pp_schedule=interleaved_1f1b",
                      "--set", "pp_virtual_stages=2", "--set", "train.steps=6", "--set", "train.log_every=3",
                      "--metrics", str(metrics), "--log-dir", str(tmp_path / "logs"), "--profile-step", "2",
                      timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "pp=2 (interleaved_1f1b, 2 stages/rank)" in proc.stdout
    # --profile-step: step 2's collectives, printed once: the pipeline's transfers beside estimate and minimum
    assert proc.stdout.count("communication of one optimizer step") == 1
    p2p = next(line.split() for line in proc.stdout.splitlines() if line.startswith("pp ") and " p2p " in line)
    assert int(p2p[2]) > 0 and "-" not in p2p[3:], p2p  # calls, payload, wire, estimate, minimum, ratios
    assert "pipeline idle" in proc.stdout
    assert "0.85M params" in proc.stdout  # the whole model's size, not the first stage's
    assert "(mean of first/last 3 steps of 6)" in proc.stdout  # windows that do not overlap (issue 32)
    losses = json.loads(metrics.read_text())["losses"]
    assert len(losses) == 6
    # --log-dir: a JSON line per logged step, with what a user watches
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [3, 6] and [r["loss"] for r in lines] == [losses[2], losses[5]]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["lr"] > 0 for r in lines)
    assert all(len(r["peak_mb_per_rank"]) == 2 for r in lines)


@pytest.mark.slow
def test_resume_from_the_command_line_continues_exactly(tmp_path):
    common = ["--nproc", "2", "--set", "pp=1", "--set", "tp=1", "--set", "dp_shard=2",
              "--set", "sequence_parallel=false", "--set", "train.steps=6", "--set", "train.log_every=1",
              "--set", f"train.save_dir={tmp_path / 'ckpt'}", "--set", "train.save_every=3"]
    full, logs = tmp_path / "full.json", tmp_path / "logs"
    # the checkpoints are written in the background (train.async_save) while the steps after them run
    proc = ultrascale("train", *common, "--set", "train.async_save=true", "--metrics", str(full), "--log-dir",
                      str(logs))
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = tmp_path / "resumed.json"
    proc = ultrascale("train", *common, "--resume", str(tmp_path / "ckpt" / "step-00000003"), "--metrics",
                      str(resumed), "--log-dir", str(logs))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout
    losses = json.loads(full.read_text())["losses"]
    assert json.loads(resumed.read_text())["losses"] == losses[3:]
    # --log-dir after a resume from step 3 of a run that logged to step 6: one curve, steps 4-6 the resumed run's
    # (they were kept and then written again, issue 47)
    lines = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6] and [r["loss"] for r in lines] == losses
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logs))  # both runs' event files; the resumed one's purge_step hides 4-6 of the first
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)


def test_a_resumed_run_supersedes_the_logged_steps_after_its_checkpoint(tmp_path):
    """Issue 47: the interrupted run's lines after the checkpoint were kept and then logged again. The resumed run's
    first logged step drops them from metrics.jsonl (written aside, then moved over: no .tmp left; a line that is not
    a record stays) and has TensorBoard hide the earlier event files' steps from the checkpoint's on."""
    from ultrascale_plugins.cli.progress import EventLog, keep_log_lines_through, write_log_line

    first = EventLog(str(tmp_path))
    for step in range(1, 7):  # the interrupted run: steps 1-6, the checkpoint at 3
        write_log_line(str(tmp_path), {"step": step, "loss": float(step)})
        first.write({"step": step, "loss": float(step)})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("a note of the user's own\n")
    keep_log_lines_through(str(tmp_path), 3)
    resumed = EventLog(str(tmp_path), purge_step=4)
    for step in range(4, 7):
        write_log_line(str(tmp_path), {"step": step, "loss": -float(step)})
        resumed.write({"step": step, "loss": -float(step)})
    resumed.close()
    text = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert text[3] == "a note of the user's own" and not list(tmp_path.glob("*.tmp"))
    lines = [json.loads(line) for line in text[:3] + text[4:]]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 1), (2, 2), (3, 3), (4, -4), (5, -5), (6, -6)]
    keep_log_lines_through(str(tmp_path / "absent"), 3)  # nothing logged there yet: nothing to do
    if first.writer is not None:  # tensorboard installed: one value per step, the resumed run's after 3
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(r["step"], r["loss"]) for r in lines]


def test_resume_from_a_bad_path_is_one_line(tmp_path):
    assert_clean_error(ultrascale("train", "--resume", str(tmp_path)), "no complete checkpoint")


COMMON_2 = ["--nproc", "2", "--set", "pp=1", "--set", "sequence_parallel=false", "--set", "train.log_every=1"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Three steps of plain data parallel on 2 processes, saved at step 3: the run exported below, and the
    checkpoint the forgery test tampers with (a copy), from one launch."""
    tmp_path = tmp_path_factory.mktemp("ddp_run")
    proc = ultrascale("train", *COMMON_2, "--set", "tp=1", "--set", "dp_shard=2", "--set", "zero_stage=0",
                      "--set", "train.steps=3", "--set", f"train.save_dir={tmp_path / 'ckpt'}", "--metrics",
                      str(tmp_path / "first.json"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, tmp_path


@pytest.mark.slow
def test_init_from_an_exported_checkpoint_in_another_layout(ddp_run, tmp_path):
    """train (plain data parallel) -> export to an HF directory -> --init-from it under TP: with lr=0 the model is unchanged,
    so the validation loss equals the first run's."""
    proc, run = ddp_run
    first = run / "first.json"
    # ZeRO-0 is said as what it is
    assert "dp_shard=2 (plain data parallel: DDP, a whole copy per rank)" in proc.stdout, proc.stdout
    assert "(a whole copy on every rank)" in proc.stdout and "sharded" not in proc.stdout
    # the command line's optimizer is torch's fused AdamW (it then runs under TP without FSDP, below)
    saved = json.loads((run / "ckpt" / "step-00000003" / "ultrascale.json").read_text())
    assert all(group["fused"] is True for group in saved["optimizer"]["param_groups"]), saved["optimizer"]
    proc = ultrascale("export", str(run / "ckpt" / "step-00000003"), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    second = tmp_path / "second.json"
    proc = ultrascale("train", *COMMON_2, "--set", "tp=2", "--set", "dp_shard=1", "--set", "train.steps=1",
                      "--set", "train.lr=0", "--set", "train.warmup_steps=0", "--init-from", str(tmp_path / "hf"),
                      "--metrics", str(second))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"from {tmp_path / 'hf'}" in proc.stdout
    a, b = json.loads(first.read_text())["val_loss"], json.loads(second.read_text())["val_loss"]
    assert abs(a - b) <= 1e-5, (a, b)


def test_init_from_a_directory_without_weights_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256}))
    assert_clean_error(ultrascale("train", "--init-from", str(tmp_path)), "no *.safetensors")


# sweep: Lightning's two-node run (tests/test_lightning.py) keeps a rendezvous of two launches in CI
@pytest.mark.slow
@pytest.mark.sweep
def test_two_nodes_sharing_a_rendezvous_equal_one_four_process_run(tmp_path):
    """--nnodes / --node-rank / --rdzv-endpoint: two `ultrascale train` invocations on this machine (2 processes
    each, the recipe's nproc is per node) make one 4-process job whose losses equal a 4-process run's."""
    import socket

    common = ["--set", "pp=1", "--set", "tp=1", "--set", "sequence_parallel=false", "--set", "dp_shard=4",
              "--set", "train.steps=3", "--set", "train.log_every=1", "--set", "train.eval_batches=1"]
    single = tmp_path / "single.json"
    proc = ultrascale("train", "--nproc", "4", *common, "--metrics", str(single))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = tmp_path / "nodes.json"
    node = [sys.executable, "-m", "ultrascale_plugins.cli.main", "train", "--nproc", "2", "--nnodes", "2",
            "--rdzv-endpoint", f"127.0.0.1:{port}", *common]
    second = subprocess.Popen([*node, "--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.run([*node, "--node-rank", "0", "--metrics", str(nodes)], capture_output=True, text=True,
                           timeout=300)
    out, err = second.communicate(timeout=300)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-3000:] + err[-3000:]
    assert json.loads(nodes.read_text())["world_size"] == 4
    assert json.loads(nodes.read_text())["losses"] == pytest.approx(json.loads(single.read_text())["losses"],
                                                                    abs=1e-6)
    for flags, words in ((["--nnodes", "2"], ("--rdzv-endpoint",)),
                         (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], ("--node-rank 2",))):
        assert_clean_error(ultrascale("train", *flags), *words)


def test_the_slurm_example_is_valid_shell_with_flags_the_command_takes():
    from pathlib import Path

    from ultrascale_plugins.cli.main import build_parser

    script = Path(__file__).resolve().parent.parent / "recipes" / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    for flag in ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint"):
        assert flag in text
    args = build_parser().parse_args(["train", "r.yaml", "--nproc", "8", "--nnodes", "4", "--node-rank", "3",
                                      "--rdzv-endpoint", "node001:29500"])
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == (4, 3, "node001:29500")


class _Payload:
    """A pickle that would create a directory when loaded: what a forged checkpoint smuggles into .metadata."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.makedirs, (self.marker,)


@pytest.mark.slow
def test_a_forged_checkpoint_runs_no_code(ddp_run, tmp_path):
    """A checkpoint whose DCP .metadata is replaced by a malicious pickle (its size and checksum in ultrascale.json
    edited to match) is refused with one line by export and by --resume (the path every front end's load takes),
    and the payload never runs. (The checkpoint: a copy of the data-parallel run's, saved by the command line.)"""
    import pickle
    import shutil
    import zlib

    one = ["--nproc", "1", "--set", "pp=1", "--set", "tp=1", "--set", "dp_shard=1", "--set", "sequence_parallel=false",
           "--set", "train.steps=1", "--set", f"train.save_dir={tmp_path / 'ckpt'}"]
    ckpt = shutil.copytree(ddp_run[1] / "ckpt" / "step-00000003", tmp_path / "ckpt" / "step-00000003")
    marker = tmp_path / "payload-ran"
    forged = pickle.dumps(_Payload(str(marker)), protocol=4)
    (ckpt / ".metadata").write_bytes(forged)
    meta = json.loads((ckpt / "ultrascale.json").read_text())
    meta["files"][".metadata"] = len(forged)
    meta["checksums"]["files"][".metadata"] = f"{zlib.crc32(forged):08x}"  # a forger edits those too
    (ckpt / "ultrascale.json").write_text(json.dumps(meta))
    assert_clean_error(ultrascale("export", str(ckpt), str(tmp_path / "hf")), "metadata", "nothing in it ran")
    assert not marker.exists() and not (tmp_path / "hf").exists()
    assert_clean_error(ultrascale("train", *one, "--resume", str(ckpt)), "metadata")
    assert not marker.exists()

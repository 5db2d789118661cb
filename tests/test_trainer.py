"""UltraScaleTrainer with TrainingArguments' defaults (its fused AdamW): Trainer's gradient accumulation in every
layout against a plain Trainer on one process; checkpoints: save_strategy="steps" writes the package's sharded
checkpoint as Trainer's ``checkpoint-N`` (rotated by save_total_limit), and ``resume_from_checkpoint`` continues
with the uninterrupted run's losses. Every layout's runs share a launch (tests/trainer_worker.py). No test passes
use_cpu=True: on CPU, TrainingArguments' defaults set Accelerate up for one process on every rank, and every launch
checks that the Trainer sees the real job anyway (``_one_job``)."""
import json
import os
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "trainer_worker.py"
LAYOUTS = {"zero3": ["dp_shard=2"], "pp": ["pp=2"], "tp": ["tp=2"]}
# 6 steps over 4 global batches (two epochs), a checkpoint every 2 steps, the newest 2 kept, evaluation every 2
# steps with load_best_model_at_end (the best checkpoint is never rotated away)
RUN = ["--max-steps", "6", "--save-steps", "2", "--save-limit", "2", "--eval-steps", "2", "--no-save-model"]
GLOBAL_BATCH = 8  # rows per optimizer step (tests/trainer_worker.py)
SAME = 1e-6   # resumed vs uninterrupted, same layout (fp32, CPU)
ACROSS = 1e-5  # another layout (reduction order differs), as tests/test_accelerate.py


def _launch(cases):
    from conftest import torchrun

    args = []
    for case in cases:
        Path(case[0]).parent.mkdir(parents=True, exist_ok=True)
        args += [*case, "--then"]
    proc = torchrun(2, WORKER, *args[:-1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-8000:]
    runs = [json.loads(Path(case[0]).read_text()) for case in cases]
    _one_job(runs, proc.stdout)
    return runs


def _one_job(runs, stdout: str) -> None:
    """With TrainingArguments' defaults on CPU, the Trainer sees the two processes torchrun started: one main
    process (the only writer of trainer_state.json), Trainer's metrics printed once per train(), not per rank."""
    for run in runs:
        ranks = run["ranks"]
        assert [r["world_size"] for r in ranks] == [2, 2] and [r["main"] for r in ranks] == [True, False], ranks
        assert ranks[1]["state_writes"] == 0, ranks  # rank 0 alone writes trainer_state.json
    finished = [run for run in runs if "samples" in run]  # (a run whose save fails on purpose does not finish)
    printed = [line for line in stdout.splitlines() if "'train_runtime'" in line]
    assert len(printed) == len(finished), printed


def _reads_disjoint_shards(run, dp: int, steps: int) -> None:
    """Each global batch of 8 rows (step k: rows 8k .. 8k+7) is split over the data-parallel replicas, disjoint
    and complete; the ranks of one replica (TP, CP, pipeline peers) read the same rows. Trainer counts those rows
    once in train_samples_per_second."""
    share = GLOBAL_BATCH // dp
    for step in range(steps):
        by_replica = {}
        for r in run["ranks"]:
            rows = r["rows"][step * share:(step + 1) * share]
            assert by_replica.setdefault(r["dp_rank"], rows) == rows, (step, run["ranks"])
        read = [i for rows in by_replica.values() for i in rows]
        assert len(by_replica) == dp and sorted(read) == list(range(step * 8, step * 8 + 8)), (step, by_replica)
    assert abs(run["samples"] - GLOBAL_BATCH * steps) < 0.5, run["samples"]


def _close(a, b, tol):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


# Trainer's gradient accumulation: 2 micro-batches per step whose rows hold very different numbers of valid tokens
# (the first is mostly padding), weighted by their tokens as a plain Trainer weights them (num_items_in_batch)
ACCUMULATION_LAYOUTS = {"zero3": ["dp_shard=2"], "zero1": ["dp_shard=2", "zero_stage=1"], "tp": ["tp=2"],
                        "tp_sp": ["tp=2", "sequence_parallel=true"], "pp": ["pp=2"], "cp": ["cp=2"],
                        # the chunked loss (no whole logits), on the pipeline's last stage
                        "pp_chunked": ["pp=2", "chunked_loss=16"],
                        # gradients reduced once per step (whole fp32 gradients held over the window)
                        "zero2_step": ["dp_shard=2", "zero_stage=2", "grad_sync=step"],
                        # expert parallel on a mixture of experts, against a plain Trainer of the same MoE
                        "ep": ["dp_shard=2", "ep=2", "--arch", "qwen3_moe"],
                        # last: TrainingArguments(torch_compile=True) sets Accelerate's variables for the process
                        "zero3_torch_compile": ["dp_shard=2", "--torch-compile"]}


def _arch(layout: list[str]) -> str:
    return layout[layout.index("--arch") + 1] if "--arch" in layout else "llama8_tied"


def _weights(directory):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


# the plain Trainer's runs on one process that the launched runs are compared with (tests/trainer_worker.py
# --reference): every architecture of ACCUMULATION_LAYOUTS, torchao's 8-bit AdamW, a PEFT model
REFERENCES = {**{f"ref-{arch}": ["--accumulate", "2", "--arch", arch]
                 for arch in sorted({_arch(layout) for layout in ACCUMULATION_LAYOUTS.values()})},
              "ref-8bit": ["--optim", "adamw_torch_8bit", "--no-save-model"],
              "ref-peft": ["--peft", "--accumulate", "2"]}
# the runs of UltraScaleTrainer the tests below check, in one launch (process start-up dominates on CPU):
# torchao's 8-bit AdamW under ZeRO-3, a PEFT model under ZeRO-3 and context parallel, and accumulation in every
# layout (the torch_compile run last, see ACCUMULATION_LAYOUTS)
LAUNCHED = {"8bit/zero3": ["dp_shard=2", "--optim", "adamw_torch_8bit", "--no-save-model"],
            **{f"peft/{name}": [*layout, "--peft", "--accumulate", "2"]
               for name, layout in {"zero3": ["dp_shard=2"], "cp": ["cp=2"]}.items()},
            **{f"accumulation/{name}": [*layout, "--accumulate", "2"] for name, layout in ACCUMULATION_LAYOUTS.items()}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{name: (its directory, its OUT.json)} for REFERENCES (one process, one run after the other) and LAUNCHED
    (one launch)."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("trainer")
    args = []
    for name, options in REFERENCES.items():
        (root / name).mkdir()
        args += [str(root / name / "out.json"), "--reference", *options, "--then"]
    proc = subprocess.run([sys.executable, str(WORKER), *args[:-1]], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = _launch([[str(root / name / "out.json"), *options] for name, options in LAUNCHED.items()])
    out = {name: (root / name, json.loads((root / name / "out.json").read_text())) for name in REFERENCES}
    out.update({name: (root / name, run) for name, run in zip(LAUNCHED, runs)})
    return out


def test_gradient_accumulation_is_trainers_in_every_layout(trained):
    wants, ref_weights = {}, {}
    for arch in {_arch(layout) for layout in ACCUMULATION_LAYOUTS.values()}:  # a plain Trainer of each model
        directory, wants[arch] = trained[f"ref-{arch}"]
        assert all(n > 0.5 for n in wants[arch]["grad_norms"]), wants  # max_grad_norm=0.5 clips at every step
        ref_weights[arch] = _weights(directory / "hf")
    for name in ACCUMULATION_LAYOUTS:
        directory, run = trained[f"accumulation/{name}"]
        want, ref_weight = wants[_arch(ACCUMULATION_LAYOUTS[name])], ref_weights[_arch(ACCUMULATION_LAYOUTS[name])]
        assert run["steps"] == [1, 2, 3, 4], (name, run)
        _reads_disjoint_shards(run, dp=2 if "dp_shard=2" in ACCUMULATION_LAYOUTS[name] else 1, steps=4)
        if "--torch-compile" in ACCUMULATION_LAYOUTS[name]:  # mapped onto compile: regional, which compiled
            assert run["compile"] == "regional" and run["compiled_graphs"] > 0, run
        assert _close(run["losses"], want["losses"], ACROSS), (name, run["losses"], want["losses"])
        assert _close(run["grad_norms"], want["grad_norms"], ACROSS), (name, run["grad_norms"], want["grad_norms"])
        weights = _weights(directory / "hf")
        assert set(weights) == set(ref_weight), name  # (expert parallel: every expert, gathered whole)
        diff = max((weights[k] - ref_weight[k]).abs().max().item() for k in ref_weight)
        assert diff <= ACROSS, (name, diff)
    assert trained["accumulation/ep"][1]["ep"] == 2  # the layout that ran


def test_torchaos_8bit_adamw_by_its_trainer_name_matches_a_plain_trainer_under_zero3(trained):
    """TrainingArguments(optim="adamw_torch_8bit"): the Trainer builds torchao's AdamW8bit on the ZeRO-3 shards
    (DTensor-aware: each shard's states quantized in 256-element blocks, which the shards' rows align with), and the
    run follows a plain Trainer's with the same optimizer on one process (8-bit states: to 1e-3)."""
    run, want = trained["8bit/zero3"][1], trained["ref-8bit"][1]
    assert _close(run["losses"], want["losses"], 1e-3), (run["losses"], want["losses"])
    assert _close(run["grad_norms"], want["grad_norms"], 1e-2), (run["grad_norms"], want["grad_norms"])


def test_trainer_checkpoints_rotate_and_resume_in_every_layout(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    # the first runs, then (in the same launch) resumes from their step-2 checkpoints (copied aside before rotation
    # deleted them), into the first runs' output directories: checkpoint-4 / -6 are replaced by the resumed run's.
    # Then a ZeRO-3 -> PP resume, and a resume whose save of checkpoint-4 fails after its shards are written.
    cases = [[str(tmp_path / name / "run.json"), *layout, *RUN, "--keep", "2", str(tmp_path / name / "kept-2")]
             for name, layout in LAYOUTS.items()]
    cases += [[str(tmp_path / name / "resumed.json"), *layout, *RUN, "--resume", str(tmp_path / name / "kept-2")]
              for name, layout in LAYOUTS.items()]
    cases.append([str(tmp_path / "across" / "resumed.json"), *LAYOUTS["pp"], *RUN, "--resume",
                  str(tmp_path / "zero3" / "kept-2"), "--output-dir", str(tmp_path / "across" / "trainer")])
    cases.append([str(tmp_path / "failed" / "resumed.json"), *LAYOUTS["zero3"], *RUN, "--resume",
                  str(tmp_path / "zero3" / "kept-2"), "--output-dir", str(tmp_path / "zero3" / "trainer"),
                  "--fail-at-save", "4"])
    launched = _launch(cases)
    runs, (*resumed, across, failed) = launched[:len(LAYOUTS)], launched[len(LAYOUTS):]
    for (name, _), run in zip(LAYOUTS.items(), runs):
        assert run["steps"] == [1, 2, 3, 4, 5, 6], (name, run)
        assert _close(run["losses"], runs[0]["losses"], ACROSS), (name, run["losses"], runs[0]["losses"])
        # the output directory as the run left it (the resumes below then write into it; the worker lists it):
        # save_total_limit=2: the newest and the best stay (Trainer's rule); nothing half-written is left around
        left = run["output_dir"]
        best = os.path.basename(run["best"])
        want = {"checkpoint-6", best} | ({"checkpoint-4"} if best == "checkpoint-6" else set())
        assert set(left) == want, (name, sorted(left), best)
        for folder in want:
            files = set(left[folder]["files"])
            assert {"ultrascale.json", "trainer_state.json", "scheduler.pt", "rng_state_0.pth",
                    "rng_state_1.pth"} <= files, (name, folder, files)
            assert f"checkpoint-{left[folder]['global_step']}" == folder
            assert left[folder]["optimizer_class"] == "AdamW"

    for (name, _), run, again in zip(LAYOUTS.items(), runs, resumed):
        assert again["steps"] == [3, 4, 5, 6], (name, again)
        assert _close(again["losses"], run["losses"][2:], SAME), (name, again["losses"], run["losses"])
        assert _close([v for _, v in again["eval"]], [v for s, v in run["eval"] if s > 2], SAME), (name, again, run)
        out = tmp_path / name / "trainer"
        assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6
        if name != "zero3":  # (the failed save below left its staging directory in zero3's)
            assert not [n for n in os.listdir(out) if n.startswith(".")], (name, os.listdir(out))
    assert across["steps"] == [3, 4, 5, 6] and _close(across["losses"], runs[0]["losses"][2:], ACROSS), across

    # a save that fails leaves the checkpoint of the same name as it was, and Trainer never picks up the partial one
    assert failed["failed"] and failed["untouched"], failed
    out = tmp_path / "zero3" / "trainer"
    assert {"checkpoint-4", "checkpoint-6"} <= set(os.listdir(out)), os.listdir(out)
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-6")


def test_a_crash_between_the_commits_steps_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    """The one commit every checkpoint takes (checkpoint.commit): a crash after the old checkpoint was moved aside
    and before the new one was moved in, or after that and before the old one was deleted, leaves a complete
    checkpoint under the name once readers have run ``recover`` (every reader does, Trainer.train included)."""
    import ultrascale_plugins.checkpoints.sharded as ckpt
    from ultrascale_plugins.checkpoints.sharded import META, commit, list_checkpoints

    def make(path, text):
        path.mkdir()
        (path / META).write_text("{}")
        (path / "state").write_text(text)

    final = tmp_path / "step-00000004"
    real_replace = os.replace
    for crash_at, want in ((2, "old"), (3, "new")):  # os.replace calls: 1 aside, 2 new in; 3 = the deletion
        for p in tmp_path.iterdir():
            __import__("shutil").rmtree(p)
        make(final, "old")
        make(tmp_path / ".tmp-step-00000004", "new")
        calls = []

        def crashing_replace(a, b, crash_at=crash_at):
            calls.append(1)
            if len(calls) == crash_at:
                raise KeyboardInterrupt("killed")
            return real_replace(a, b)

        monkeypatch.setattr(ckpt.os, "replace", crashing_replace)
        if crash_at == 3:  # the crash comes while deleting the old one
            monkeypatch.setattr(ckpt.shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            commit(tmp_path / ".tmp-step-00000004", final)
        monkeypatch.undo()
        assert list_checkpoints(tmp_path) == [final], os.listdir(tmp_path)  # recovered by the reader
        assert (final / "state").read_text() == want
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".replaced-")]


def test_a_peft_model_trains_as_in_a_plain_trainer(trained):
    """UltraScaleTrainer with a PEFT (LoRA) model under ZeRO-3 and context parallel: Trainer's accumulation,
    logged losses and gradient norms equal a plain Trainer's with the same PEFT model on one process, and
    save_model writes the adapters in PEFT's format, as Trainer does, equal to the plain Trainer's."""
    from safetensors.torch import load_file

    ref, want = trained["ref-peft"]
    ref_adapters = load_file(ref / "hf" / "adapter_model.safetensors")
    for name in ("zero3", "cp"):
        directory, run = trained[f"peft/{name}"]
        assert _close(run["losses"], want["losses"], ACROSS), (run["losses"], want["losses"])
        assert _close(run["grad_norms"], want["grad_norms"], ACROSS), (run["grad_norms"], want["grad_norms"])
        assert not list((directory / "hf").glob("model*.safetensors")), "save_model wrote the whole model"
        adapters = load_file(directory / "hf" / "adapter_model.safetensors")
        assert set(adapters) == set(ref_adapters) and ref_adapters
        assert max((adapters[k] - ref_adapters[k]).abs().max().item() for k in adapters) <= ACROSS, name


def test_expert_parallel_is_checked_against_trainers_model_before_accelerates_process_group(monkeypatch, capsys):
    """UltraScaleTrainer hands its model to UltraScaleAccelerator, which checks the layout against it (ep against
    the experts, zero_stage 2 or 3 for them) before Accelerate starts its process group: in launched workers, one
    line from rank 0 and exit status 2 on every rank, not a traceback per rank from the first train() step.
    (TrainingArguments itself starts the process group when it is built in launched workers; here it is not.)"""
    import torch

    from models import make_model
    from ultrascale_plugins.integrations.accelerate import UltraScaleAccelerator, UltraScalePlugin

    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29599"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *a, **k: pytest.fail("the process group was started before the check"))
    cases = [("qwen3_moe", {"ep": 3}, "ep=3: expert parallelism borrows its ranks from dp_shard*cp*tp = 2*1*1 = 2, "
              "which 3 does not divide. Fix: pick an ep that divides 2"),
             ("llama", {"ep": 2}, "ep=2: model type 'llama' has no routed experts. Fix: use ep: 1"),
             ("qwen3_moe", {"ep": 2, "zero_stage": 1}, "zero_stage=1: ep=2 shards the experts"),
             ("qwen3_moe", {"ep": 2, "dp_shard": 2, "tp": 1}, None)]  # a good layout goes on to Accelerate
    for arch, fields, said in cases:
        model = make_model(arch)
        if said is None:
            from accelerate.state import AcceleratorState

            try:
                with pytest.raises(pytest.fail.Exception, match="process group was started"):
                    UltraScaleAccelerator(ultrascale_plugin=UltraScalePlugin(**fields), _ultrascale_model=model)
            finally:
                AcceleratorState._reset_state(True)  # Accelerate's shared state, left half set up
            continue
        with pytest.raises(SystemExit) as exc:
            UltraScaleAccelerator(ultrascale_plugin=UltraScalePlugin(**fields), _ultrascale_model=model)
        assert exc.value.code == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ultrascale")]
        assert len(lines) == 1 and lines[0].startswith(f"ultrascale: error: {said}"), lines
    assert lines[0].endswith("Fix: use zero_stage: 2 or 3, or ep: 1")


def as_launched_rank(monkeypatch, rank: int) -> None:
    """This process as global rank ``rank`` of a 2-process torchrun job (its environment; no process group)."""
    from ultrascale_plugins.distributed import launch

    for key, value in {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "SAY_FIRST_S", 0)  # rank 1's wait for rank 0's line


@pytest.mark.parametrize("fields,said", [
    ({"tpp": 2}, "unknown parallel key 'tpp' (tpp=2): no installed plugin declares it. Fix: did you mean 'tp'?"),
    ({"sequence_parallel": "yes"}, "sequence_parallel='yes': must be true or false or auto. Fix: e.g. "
                                   "sequence_parallel: False")])
def test_a_bad_plugin_argument_is_one_line_from_rank_0_in_launched_workers(monkeypatch, capsys, fields, said):
    """UltraScalePlugin(tpp=2) (the Trainer's, TRL's and Accelerate's) in a torchrun worker: rank 0 says the field,
    the value and the fix in one line and exits with status 2, rank 1 exits with status 2 saying nothing; no
    traceback from either (SystemExit prints none). In one process it stays an exception to catch."""
    from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
    from ultrascale_plugins.interface.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        UltraScalePlugin(**fields)
    assert str(refused.value).startswith(said)
    for rank in (0, 1):
        as_launched_rank(monkeypatch, rank)
        with pytest.raises(SystemExit) as exc:
            UltraScalePlugin(**fields)
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert len(err.splitlines()) == (rank == 0), err
        assert rank != 0 or err.startswith(f"ultrascale: error: {said}"), err


@pytest.mark.slow
def test_a_layout_the_trainer_cannot_run_is_one_line_under_plain_torchrun(tmp_path):
    """UltraScalePlugin(tp=3) on 2 processes under plain torchrun, TrainingArguments' defaults: rank 0 says one line
    naming the degrees and the fix, no rank prints a traceback, every worker exits with status 2. What follows is
    torchrun's own report of failed workers (its ChildFailedError block, under a traceback of torchrun itself), and
    torchrun's exit status is 1, which it gives whenever a worker fails -- as docs/trainer.md says."""
    import re

    from conftest import torchrun

    proc = torchrun(2, WORKER, str(tmp_path / "out.json"), "tp=3", timeout=300)
    said = [line for line in proc.stderr.splitlines() if "ultrascale: error:" in line]
    assert said == ["ultrascale: error: pp*dp_replicate*cp*tp = 1*1*1*3 = 3 does not divide the world size 2. Fix: "
                    "pick degrees whose product divides 2"], proc.stderr[-4000:]
    assert "ConfigError" not in proc.stderr and not re.search(r"\[rank\d\]: *Traceback", proc.stderr), proc.stderr
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr and "exitcode  : 2" in proc.stderr

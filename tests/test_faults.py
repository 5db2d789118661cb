"""A failing or stalled rank ends the job with an error within the collective timeout, never a hang."""
import json
import time
from pathlib import Path

import pytest

from conftest import torchrun

WORKER = Path(__file__).parent / "fault_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode, words", [("raise", "injected failure on rank 1"), ("stall", "")])
def test_one_bad_rank_fails_the_job_quickly(mode, words):
    start = time.monotonic()
    proc = torchrun(2, WORKER, mode, "8", timeout=240, env={"PYTHONPATH": str(WORKER.parent)})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "finished" not in proc.stdout
    assert words in proc.stdout + proc.stderr
    assert elapsed < 120, f"took {elapsed:.0f}s"


@pytest.mark.slow
def test_kill_during_save_keeps_the_last_checkpoint_and_restart_reproduces(tmp_path):
    env = {"PYTHONPATH": str(WORKER.parent)}
    start = time.monotonic()
    proc = torchrun(2, WORKER, "kill_in_save", "8", str(tmp_path), timeout=240, env=env)
    assert proc.returncode != 0 and "finished" not in proc.stdout
    assert time.monotonic() - start < 120
    from ultrascale_plugins.checkpoint import list_checkpoints

    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003"]  # step 5 never became visible
    proc = torchrun(2, WORKER, "restart", "60", str(tmp_path), timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["step"] == 3
    assert result["resumed"] == result["uninterrupted"][3:]  # bit for bit

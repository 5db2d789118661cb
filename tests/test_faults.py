"""A failing or stalled rank ends the job with an error within the collective timeout, never a hang."""
import sys
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

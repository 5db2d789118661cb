"""A failing or stalled rank ends the job with an error within the collective timeout, never a hang."""
import json
import os
import subprocess
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


@pytest.mark.slow
def test_kill_during_save_keeps_the_last_checkpoint_and_restart_reproduces(tmp_path):
    env = {"PYTHONPATH": str(WORKER.parent)}
    start = time.monotonic()
    proc = torchrun(2, WORKER, "kill_in_save", "8", str(tmp_path), timeout=240, env=env)
    assert proc.returncode != 0 and "finished" not in proc.stdout
    assert time.monotonic() - start < 120
    from ultrascale_plugins.checkpoints.sharded import list_checkpoints

    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003"]  # step 5 never became visible
    proc = torchrun(2, WORKER, "restart", "60", str(tmp_path), timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # raw_decode: the other rank's "finished" can land on the same line (two processes share the pipe)
    result, _ = json.JSONDecoder().raw_decode(proc.stdout.split("RESULT ", 1)[1])
    assert result["step"] == 3
    assert result["resumed"] == result["uninterrupted"][3:]  # bit for bit


def test_a_script_that_forgets_to_destroy_the_process_group_still_exits_cleanly():
    """The exit hook (launch.destroy_process_group_at_exit) tears the group down while the interpreter is still
    whole: the CI once saw an Accelerate worker abort at exit after finishing its training."""
    script = ("import atexit, torch.distributed as dist\n"
              "from ultrascale_plugins.distributed.launch import init_distributed\n"
              "init_distributed(timeout=30)\n"
              "assert dist.is_initialized()\n"
              "atexit._run_exitfuncs()\n"
              "print('destroyed' if not dist.is_initialized() else 'still initialized')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "destroyed", proc.stdout + proc.stderr[-3000:]


def test_a_launch_is_run_once_more_only_after_a_native_crash():
    """tests/conftest.py:retry_native_crash: a rank killed by a signal in native code (gloo's rare transport crash)
    gets the launch run once more, reported; a Python error or a wrong result is returned as it is."""
    import conftest

    def launches(*results):
        calls = []

        def launch():
            calls.append(len(calls))
            code, err = results[len(calls) - 1]
            return subprocess.CompletedProcess([], code, "", err)

        return launch, calls

    crashed = (1, "exitcode  : -6 (pid: 1)  (SIGABRT)\n  traceback : Signal 6 (SIGABRT) received by PID 1")
    before = len(conftest.NATIVE_CRASHES)
    launch, calls = launches(crashed, (0, ""))
    assert conftest.retry_native_crash(launch, "demo").returncode == 0 and len(calls) == 2
    assert len(conftest.NATIVE_CRASHES) == before + 1 and conftest.NATIVE_CRASHES.pop().startswith("demo: ")
    launch, calls = launches((1, "Traceback ...\nAssertionError: loss differs"), (0, ""))
    assert conftest.retry_native_crash(launch, "demo").returncode == 1 and len(calls) == 1
    launch, calls = launches(crashed, crashed)
    assert conftest.retry_native_crash(launch, "demo").returncode == 1 and len(calls) == 2
    conftest.NATIVE_CRASHES.pop()

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def torchrun(nproc: int, script: str, *args: str, timeout: float = 600, env: dict | None = None):
    """Run a script on ``nproc`` local processes (gloo) and return the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max_restarts", "0", str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture(scope="session")
def parity_results(tmp_path_factory, pytestconfig):
    """All parity cases, run once per world size (one launch each: process start-up dominates on CPU)."""
    from parity_cases import CASES

    results, failures = {}, {}
    for world in sorted({c["world"] for c in CASES.values()}):
        names = [n for n, c in CASES.items() if c["world"] == world]
        out = tmp_path_factory.mktemp(f"parity{world}") / "results.json"
        proc = torchrun(world, TESTS / "parity_worker.py", str(out), *names)
        if proc.returncode != 0 or not out.exists():
            for n in names:
                failures[n] = proc.stdout[-3000:] + proc.stderr[-6000:]
            continue
        results.update(json.loads(out.read_text()))
    pytestconfig._parity_results = results
    return results, failures


def pytest_terminal_summary(terminalreporter):
    """Print the observed parity tolerances (quoted in closing notes)."""
    results = getattr(terminalreporter.config, "_parity_results", None)
    if not results:
        return
    terminalreporter.write_sep("-", "parity: max |loss - reference| and max |weight - reference| (fp32)")
    for name, r in results.items():
        terminalreporter.write_line(f"{name:<24} loss {r['loss_diff']:.2e}   weights {r['weight_diff']:.2e}")

"""The GPU suite (benchmarks/gpu_suite.py) runs end to end: its CPU dry run executes every section's code on gloo
with tiny sizes, and every section must produce rows with no error, timeout or failed check. Skips are allowed only
for the reason listed here (compiling the throughput models on a CPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
# why a dry-run row may be skipped: the throughput modes that compile (too slow on 2 cores; the compile section
# checks the compiled model)
ALLOWED_SKIPS = ("dry run: compiling on the CPU",)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # budgets x3: the shared CI machine runs other tests at the same time (the suite's own wall time is reported)
    proc = subprocess.run([sys.executable, str(SUITE), "--dry-run", "--out", str(out), "--budget-scale", "3"],
                          capture_output=True, text=True, env=env, timeout=1200)
    files = sorted(out.glob("*.json"))
    assert files, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(files[0].read_text()), files[0].with_suffix(".md").read_text()


@pytest.mark.slow
def test_dry_run_every_section_has_rows_and_none_failed(dry_run):
    from gpu_suite import SECTIONS

    proc, result, _ = dry_run
    assert result["dry_run"] and set(result["sections"]) == set(SECTIONS)
    bad = [r for sec in result["sections"].values() for r in sec["rows"]
           if r["status"] not in ("pass", "ok", "skipped")]
    assert not bad, json.dumps(bad, indent=1)[:6000]
    for name, sec in result["sections"].items():
        assert sec["rows"], name
        assert any(r["status"] in ("pass", "ok") for r in sec["rows"]) or name == "cp_kernels", (name, sec["rows"])
    skips = [r for sec in result["sections"].values() for r in sec["rows"] if r["status"] == "skipped"]
    for row in skips:
        assert row["reason"].startswith(ALLOWED_SKIPS), row
    assert len(skips) <= 3, skips
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.slow
def test_dry_run_report_has_versions_commands_and_each_section(dry_run):
    _, result, md = dry_run
    for package in ("torch", "transformers", "accelerate", "lightning", "torchao"):
        assert package in result["versions"] and f"{package} " in md
    assert "--dry-run" in result["commands"][0] and "CPU dry run" in md
    for name in result["sections"]:
        assert f"## {name}" in md
    throughput = [r for r in result["sections"]["throughput_1b"]["rows"] if r["status"] == "ok"]
    assert throughput and all(r["tokens_per_s"] > 0 and r["planner_peak_gb"] > 0 for r in throughput)


def test_section_that_overruns_or_crashes_keeps_its_rows(tmp_path, monkeypatch):
    """The driver's bookkeeping without a model: rows written before a timeout or a crash survive, and the
    timeout or error is recorded after them."""
    import gpu_suite
    from gpu_sections.common import Recorder, Sizes

    rows = tmp_path / "s.jsonl"
    Recorder(rows, "demo").check("a check", 0.5, 1.0)
    for status in ("timeout", "error"):
        monkeypatch.setattr(gpu_suite, "spawn", lambda *a, status=status: (status, "log"))
        result = gpu_suite.section_result("demo", rows, Sizes.dry(), 5)
        assert [r["status"] for r in result["rows"]] == ["pass", status]
    assert Recorder(rows, "demo").check("nan", float("nan"), 1.0)["status"] == "fail"


def test_mfu_and_memory_ratio():
    from gpu_sections.throughput import memory_ratio, mfu

    assert mfu(10_000, 9e9, 989) == pytest.approx(10_000 * 9e9 / 989e12)
    assert memory_ratio(None, 10.0) is None and memory_ratio(11.0, 10.0) == pytest.approx(1.1)

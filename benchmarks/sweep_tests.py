"""The sweep cells left out of CI's run: the tests marked ``sweep`` (pyproject.toml), each the costliest cell of a
sweep whose other cells CI runs, with the same assertions.

    python benchmarks/sweep_tests.py     # writes results/sweep_tests.json, about 3 minutes on 2 cores

Each test's outcome and wall time, the date, the machine and the versions; exit status 1 if any failed.
"""
from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "sweep_tests.json"


def main() -> int:
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "sweep", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={report}"], cwd=ROOT, capture_output=True, text=True)
        cases = []
        for case in ET.parse(report).getroot().iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            cases.append({"test": f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}",
                          "outcome": "failed" if failed else "skipped" if skipped else "passed",
                          "seconds": round(float(case.get("time", 0)), 1)})
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, "
              f"{__import__('os').cpu_count()} cores, CPU only", "torch": torch.__version__,
              "transformers": transformers.__version__, "command": "python benchmarks/sweep_tests.py",
              "cases": cases}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    for c in cases:
        print(f"{c['outcome']:7s} {c['seconds']:6.1f} s  {c['test']}")
    if not cases:
        print(proc.stdout[-3000:] + proc.stderr[-3000:])
    return 0 if cases and proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

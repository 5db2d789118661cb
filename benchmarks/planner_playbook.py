"""The planner's cost model against the Ultra-Scale Playbook's 1,649 measured runs (1B and 3B Llama-style models
on 1-64 nodes of 8 H100): memory error, out-of-memory/crash classification, throughput ranking inside each
(model, nodes) cell, and whether the measured best layout is in the planner's top 5.

    python benchmarks/planner_playbook.py            # writes benchmarks/results/planner_playbook.json

Constants: ``ultrascale_plugins.planner.constants.CONSTANTS`` (global, few, stated in docs/planner.md); nothing is fitted
per row. Runs in a few seconds on a laptop CPU.
"""
from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ultrascale_plugins.planner import validation  # noqa: E402
from ultrascale_plugins.planner.constants import CONSTANTS  # noqa: E402


def main() -> None:
    start = time.perf_counter()
    report = validation.validate()
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["constants"] = CONSTANTS
    report["command"] = "python benchmarks/planner_playbook.py"
    report["date"] = datetime.date.today().isoformat()
    report["machine"] = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    out = ROOT / "benchmarks" / "results" / "planner_playbook.json"
    out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    for key, value in report["figures"].items():
        target = report["targets"].get(key)
        verdict = "" if target is None else (f"target {'<=' if key.startswith('memory') else '>='} {target}   "
                                             + ("met" if report["met"][key] else "NOT met"))
        print(f"{key:<26} {value:7.3f}   {verdict}")
    print(f"wrote {out.relative_to(ROOT)} ({report['rows']} rows, {report['cells']} cells, {report['seconds']} s)")


if __name__ == "__main__":
    main()

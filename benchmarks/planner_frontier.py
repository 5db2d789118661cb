"""The planner's throughput model against the ORNL Frontier study (22B, 175B and 1T GPT models with
Megatron-DeepSpeed on MI250X; ``ultrascale_plugins.planner.frontier`` has the sources): the predicted hardware
FLOPs utilization of each published layout beside the published percentage of peak, and its predicted memory per
die under the profile of the system that ran it (Megatron-DeepSpeed), which must fit, as every run did.

    python benchmarks/planner_frontier.py            # writes benchmarks/results/planner_frontier.json

Runs in a few seconds on a laptop CPU (the models are built on the meta device).
"""
from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ultrascale_plugins.planner import frontier  # noqa: E402
from ultrascale_plugins.planner.constants import CONSTANTS  # noqa: E402


def main() -> None:
    report = frontier.validate()
    report.update(constants=CONSTANTS, command="python benchmarks/planner_frontier.py",
                  date=datetime.date.today().isoformat(),
                  machine=f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}")
    out = ROOT / "benchmarks" / "results" / "planner_frontier.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'model':<6} {'GPUs':>5} {'published':>9} {'HFU':>6} {'MFU':>6} {'gap':>6} {'GB/die':>7} {'B/param':>7}")
    for name, run in report["runs"].items():
        print(f"{name:<6} {run['gpus']:>5} {run['published_pct']:>8.2f}% {run['predicted_hfu_pct']:>5.1f}% "
              f"{run['predicted_mfu_pct']:>5.1f}% {run['gap_points']:>+6.1f} {run['predicted_gb']:>7.1f} "
              f"{run['bytes_per_param']:>7.2f}")
    print(f"largest gap {report['largest_gap_points']:.1f} points (target <= {report['target_points']:g}): "
          + ("met" if report["met"] else "NOT met"))
    print(f"memory ({report['profile']} profile): "
          + ("every run fits" if report["all_fit"] else "NOT every run fits") + f" its {report['gpu_memory_gb']:g} GB die")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

"""The parity cases too costly for CI's 2 cores, checked as CI checks every other case (tests/test_parity.py).

    python benchmarks/parity_large.py        # writes results/parity_large.json, about 4 minutes on 2 cores

The cases (tests/parity_cases.py ``LARGE``): every dimension at once on 16 processes (dp2 x cp2 x tp2 + SP x pp2,
packed documents, ring attention), the 8-process compositions but Frontier's pp x tp x ZeRO-1 (pp x tp x dp with
SP and with ZBV, dp x cp x tp with either attention, cp x tp x pp with either), and regional compile of ZeRO-3 x
TP + SP, of a pipeline and of context parallel. Each runs the same worker as the test suite's parity launches
(tests/parity_worker.py) and must pass the same assertions; the same dimensions in fewer at once are in CI.
"""
from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
OUT = ROOT / "benchmarks" / "results" / "parity_large.json"


def main() -> int:
    sys.path.insert(0, str(TESTS))
    import torch
    import transformers
    from conftest import torchrun
    from parity_cases import CASES, LARGE
    from test_parity import check

    rows, ok = {}, True
    for world in sorted({CASES[n]["world"] for n in LARGE}):
        names = [n for n in LARGE if CASES[n]["world"] == world]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "results.json"
            start = time.time()
            proc = torchrun(world, str(TESTS / "parity_worker.py"), str(out), *names, timeout=1200)
            wall = round(time.time() - start, 1)
            results = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else {}
        for name in names:
            r = results.get(name)
            try:
                if r is None:
                    raise AssertionError(f"launch failed: {proc.stderr[-2000:]}")
                check(name, r)
                verdict = "pass"
            except AssertionError as exc:
                verdict, ok = f"fail: {str(exc)[:300]}", False
            rows[name] = {"world": world, "layout": CASES[name]["layout"], "verdict": verdict, "launch_s": wall,
                          **({k: r[k] for k in ("loss_diff", "weight_diff", "norm_rel_diff", "seconds") if k in r}
                             if r else {})}
            print(name, json.dumps(rows[name]), flush=True)
    OUT.write_text(json.dumps({"date": datetime.date.today().isoformat(),
                               "machine": f"{platform.machine()}, CPU, gloo", "torch": torch.__version__,
                               "transformers": transformers.__version__, "cases": rows}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

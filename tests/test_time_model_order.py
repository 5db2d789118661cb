"""The calibrated time model orders two layouts as this machine ran them: with a profile from ``ultrascale calibrate
--quick``, the planner's step time of the layout ``benchmarks/time_model_cpu.py`` measured fastest of the pair is
below that of the one it measured far slower (an ordering, not a timing threshold: the machine is shared)."""
from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from ultrascale_plugins.cli.main import main as cli

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "time_model_cpu.json"
FAST, SLOW = "ddp", "zero3_ga4"  # measured at least 1.5 times apart in every round of the committed run


def test_the_calibrated_planner_orders_two_layouts_as_measured(tmp_path, monkeypatch):
    cells = json.loads(RESULTS.read_text())["summary"]["cells"]
    rounds = zip(cells[FAST]["round_medians_s"], cells[SLOW]["round_medians_s"])
    assert all(slow > 1.5 * fast for fast, slow in rounds), (cells[FAST], cells[SLOW])  # the premise: a wide margin
    profile = tmp_path / "hw.json"
    monkeypatch.setenv("ULTRASCALE_DEVICE", "cpu")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli(["calibrate", "--quick", "--nproc", "2", "--out", str(profile)]) == 0, printed.getvalue()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import time_model_cpu as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(bench, "CELLS", [c for c in bench.CELLS if c[0] in (FAST, SLOW)])
    dirs = {}
    for key, model in (("dense", bench.DENSE), ("moe", bench.MOE)):
        (tmp_path / key).mkdir()
        (tmp_path / key / "config.json").write_text(json.dumps(model))
        dirs[key] = str(tmp_path / key)
    predicted = bench.predict(dirs, str(profile))
    assert predicted[FAST]["step_s"] < predicted[SLOW]["step_s"], predicted


def test_the_step_kernels_are_priced_only_by_a_profile(tmp_path):
    """The presets keep their GPU-chosen constants: no attention, element-wise or optimizer term of their own."""
    from ultrascale_plugins.planner.cost import CostModel, Workload, layout_from_string
    from ultrascale_plugins.planner.hardware import PRESETS
    from ultrascale_plugins.planner.model_spec import ModelSpec, load_model_config

    cost = CostModel(ModelSpec.of(load_model_config("llama-3.2-1b")), PRESETS["h100-sxm-80gb"], Workload(1024, 16))
    times = cost.evaluate(layout_from_string("dp=8,zero=3,mbs=2,ga=1", 8, cost.pm)).times_s
    assert not {"attention", "elementwise", "optimizer"} & set(times), times

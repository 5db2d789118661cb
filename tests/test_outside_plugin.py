"""A dimension plugin that lives outside the package (tests/outside_plugin: a second data-parallel axis with its
own field, batch split, gradient averaging, token counting, step wrapper, checkpoint state and a model transform
placed among the built-ins), installed through
the ``ultrascale_plugins`` entry-point group, reproduces the single-process run through the Python API and the
command line with no change to the package. (Lightning and Accelerate: tests/test_lightning.py and
tests/test_accelerate.py, ``*outside_plugin*``.)"""
import json
import os
import subprocess
import sys

import pytest

from conftest import TESTS, outside_plugin_env, torchrun

TOL = 1e-5


@pytest.mark.slow
def test_python_api_parity_with_the_outside_axis(tmp_path):
    from parity_cases import OUTSIDE_CASES

    out = tmp_path / "results.json"
    proc = torchrun(4, TESTS / "parity_worker.py", str(out), *OUTSIDE_CASES, env=outside_plugin_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    for name, spec in OUTSIDE_CASES.items():
        r = results[name]
        assert r["ranks_agree"] and r["clipped"] and not r["missing_keys"], (name, r)
        assert r["loss_diff"] <= TOL and r["weight_diff"] <= TOL and r["norm_rel_diff"] <= TOL, (name, r)
        assert r["eval_diff"] <= TOL, (name, r)
        for held, predicted in r["bytes_held"]:  # the planner's per-rank bytes, with the outside axis in the mesh
            assert held == predicted, (name, held, predicted)
        if spec.get("roundtrip"):
            assert r["roundtrip"], name
        if spec["layout"].get("acme_fused_norm"):  # its model transform ran (and kept parity, above)
            assert r["plugin_state"]["acme_fused_norms"] > 0, (name, r["plugin_state"])
        # its audit stage, declared after "tp" and before "dp", saw tensor parallel's shards exactly when the layout
        # has TP, and never FSDP's wrapping (acme2_zero3_dp2 has it)
        assert (r["plugin_state"]["acme_saw_tp_shards"] > 0) == (spec["layout"].get("tp", 1) > 1), (name, r)
        assert r["plugin_state"]["acme_saw_fsdp"] == 0, (name, r)


def _train(tmp_path, name, nproc, *sets):
    metrics = tmp_path / f"{name}.json"
    common = ["--set", "pp=1", "--set", "tp=1", "--set", "sequence_parallel=false", "--set", "train.steps=4",
              "--set", "train.log_every=1", "--set", "train.eval_batches=1"]
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "train", "--nproc", str(nproc), *common,
                           *sets, "--metrics", str(metrics)], capture_output=True, text=True, timeout=600,
                          env=outside_plugin_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(metrics.read_text())


@pytest.mark.slow
@pytest.mark.sweep  # benchmarks/sweep_tests.py; the outside axis's parity through the Python API in CI
def test_command_line_parity_with_the_outside_axis(tmp_path):
    one = _train(tmp_path, "one", 1, "--set", "dp_shard=1")
    four = _train(tmp_path, "acme", 4, "--set", "dp_shard=2", "--set", "acme_dp=2")
    assert len(four["losses"]) == len(one["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(four["losses"], one["losses"])) <= TOL, (four["losses"], one["losses"])
    assert abs(four["val_loss"] - one["val_loss"]) <= TOL


def test_outside_field_is_checked_before_launch(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "train", "--set", "acme_dp=0"],
                          capture_output=True, text=True, timeout=120, env=outside_plugin_env())
    assert proc.returncode == 2 and "acme_dp=0: must be at least 1" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "train", "--set", "acme_dp=2"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ULTRASCALE_PLUGINS": ""})
    assert proc.returncode == 2 and "unknown parallel key 'acme_dp'" in proc.stderr, proc.stderr

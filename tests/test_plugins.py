"""The pluggy spine: built-ins are plugins, third parties join through hooks or the entry point."""
import os
import subprocess
import sys
import textwrap

import pluggy
import pytest
import torch
import torch.distributed as dist

import ultrascale_plugins as us
from models import make_model, padded_batches
from ultrascale_plugins import hookimpl, plugins
from ultrascale_plugins.hookspecs import TRANSFORM_PHASES


@pytest.fixture
def single_process():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_builtins_are_registered_as_plugins():
    names = {row["name"]: row for row in us.list_plugins()}
    for builtin in plugins.DEFAULT_PLUGINS:
        assert builtin in names
        assert names[builtin]["source"] == "builtin"
    assert "ultrascale_transform_model" in names["ultrascale_plugins.dims.tensor"]["hooks"]


def test_third_party_hooks_run_in_order_during_parallelize(single_process):
    calls = []

    class Recorder:
        @hookimpl
        def ultrascale_transform_model(self, model, ctx, phase):
            calls.append(phase)

        @hookimpl
        def ultrascale_mesh_axes(self, config):
            return [("expert", 1)]

    recorder = Recorder()
    us.register(recorder, name="recorder")
    try:
        pmodel = us.parallelize(make_model("llama"), us.ParallelConfig())
        assert calls == list(TRANSFORM_PHASES)
        batch = padded_batches(1)[0]
        ref = make_model("llama")(**batch).loss
        assert torch.allclose(pmodel.train_step(batch), ref, atol=1e-6)
    finally:
        plugins.unregister(name="recorder")


def test_first_train_step_result_wins(single_process):
    class CustomStep:
        @hookimpl(tryfirst=True)
        def ultrascale_train_step(self, pmodel, batch):
            return torch.tensor(42.0)

    us.register(CustomStep(), name="custom-step")
    try:
        pmodel = us.parallelize(make_model("llama"), us.ParallelConfig())
        assert pmodel.train_step(padded_batches(1)[0]).item() == 42.0
    finally:
        plugins.unregister(name="custom-step")


def test_unknown_hook_name_fails_fast():
    class Typo:
        @hookimpl
        def ultrascale_transfrom_model(self, model, ctx, phase):
            pass

    with pytest.raises(pluggy.PluginValidationError, match="ultrascale_transfrom_model"):
        us.register(Typo(), name="typo")
    plugins.unregister(name="typo")


def _install_entry_point_plugin(tmp_path):
    (tmp_path / "acme_dim.py").write_text(textwrap.dedent("""
        import ultrascale_plugins

        @ultrascale_plugins.hookimpl
        def ultrascale_estimate(config, model_config, estimate):
            estimate["acme"] = 1
    """))
    info = tmp_path / "acme_dim-0.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-dim\nVersion: 0.3.1\n")
    (info / "entry_points.txt").write_text("[ultrascale_plugins]\nacme = acme_dim\n")


def _plugins_cli(tmp_path, **env):
    full = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    return subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli", "plugins"], capture_output=True,
                          text=True, env=full, timeout=120)


def test_entry_point_plugin_appears_in_cli(tmp_path):
    _install_entry_point_plugin(tmp_path)
    out = _plugins_cli(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "acme" in out.stdout and "acme-dim 0.3.1" in out.stdout
    assert "ultrascale_estimate" in out.stdout.split("acme", 1)[1]
    assert "ultrascale_plugins.dims.tensor" in out.stdout


def test_environment_variable_restricts_entry_points(tmp_path):
    _install_entry_point_plugin(tmp_path)
    out = _plugins_cli(tmp_path, ULTRASCALE_PLUGINS="")
    assert out.returncode == 0, out.stderr
    assert "acme" not in out.stdout
    assert "ultrascale_plugins.dims.tensor" in out.stdout
    assert "acme" in _plugins_cli(tmp_path, ULTRASCALE_PLUGINS="acme,other").stdout

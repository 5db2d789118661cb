"""Start-up work done once (issue 21, item 6): the workers ``ultrascale train`` starts skip the meta-device dry runs
the command already ran on the same layout, world, model and plugins, and only those; a worker started any other
way (plain torchrun) runs every check. The timing marks of ``benchmarks/startup.py`` and the lazy package import.
Times are measured in benchmarks/startup.py, not here."""
import json
import os
import subprocess
import sys

import pytest

import ultrascale_plugins
import ultrascale_plugins as us
from ultrascale_plugins.cli import main as cli
from ultrascale_plugins.core import engine
from ultrascale_plugins.interface.config import ConfigError
from ultrascale_plugins.interface.hookspecs import hookimpl
from ultrascale_plugins.data.recipe import load_recipe

ISSUE_COMMAND = ["dp_shard=-1", "nproc=4"]  # ultrascale train --nproc 4 --set dp_shard=-1


def meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


class CountModelChecks:
    """A plugin that counts the module-tree checks (``ultrascale_validate_model``) it is asked for."""

    def __init__(self):
        self.calls = 0

    @hookimpl
    def ultrascale_validate_model(self, model, plan, config):
        self.calls += 1


@pytest.fixture
def counter():
    plugin = CountModelChecks()
    us.register(plugin, name="count-model-checks")
    try:
        yield plugin
    finally:
        us.unregister(name="count-model-checks")


def test_the_workers_fingerprint_is_the_one_the_command_hands_them(monkeypatch):
    monkeypatch.delenv(engine.VALIDATED_ENV, raising=False)
    launcher = load_recipe(None, ISSUE_COMMAND)
    handed = cli.check_recipe(launcher)
    assert handed
    # what a worker of that launch does: its own recipe at the launched world size, its own meta model
    worker = load_recipe(None, ISSUE_COMMAND, world_size=4)
    model = meta_model(worker.model_config())
    resolved = engine.validate(worker.parallel, model.config, 4)
    assert engine.validated_fingerprint(resolved, 4, model) == handed
    # another world size, layout or model is another fingerprint
    assert engine.validated_fingerprint(resolved, 8, model) != handed
    assert engine.validated_fingerprint(resolved.replace(zero_stage=2), 4, model) != handed
    other = load_recipe(None, [*ISSUE_COMMAND, "model.num_hidden_layers=6"], world_size=4)
    assert engine.validated_fingerprint(resolved, 4, meta_model(other.model_config())) != handed


def test_the_dry_runs_are_skipped_only_with_the_matching_fingerprint(monkeypatch, counter):
    recipe = load_recipe(None, ISSUE_COMMAND, world_size=4)
    model = meta_model(recipe.model_config())
    monkeypatch.delenv(engine.VALIDATED_ENV, raising=False)
    resolved = engine.validate(recipe.parallel, model.config, 4, model=model)  # plain torchrun: every check
    assert counter.calls == 1
    fingerprint = engine.validated_fingerprint(resolved, 4, model)  # taken with the counting plugin registered
    monkeypatch.setenv(engine.VALIDATED_ENV, "not-this-one")
    engine.validate(recipe.parallel, model.config, 4, model=model)
    assert counter.calls == 2
    monkeypatch.setenv(engine.VALIDATED_ENV, fingerprint)
    assert engine.validate(recipe.parallel, model.config, 4, model=model).to_dict() == resolved.to_dict()
    assert counter.calls == 2  # the launcher ran them on this very layout, world, model and plugins
    # the layout checks without a model (degrees vs world size) always run
    with pytest.raises(ConfigError):
        engine.validate(recipe.parallel, model.config, 6, model=model)


def test_a_fingerprint_does_not_let_another_model_through(monkeypatch):
    """A GPT-2 has no pipeline plan: refused with pp=2 even when the environment holds a fingerprint of a recipe
    that passed (a worker started by hand, or under another launch)."""
    good = load_recipe(None, ISSUE_COMMAND, world_size=4)
    good_model = meta_model(good.model_config())
    monkeypatch.setenv(engine.VALIDATED_ENV, engine.validated_fingerprint(
        engine.validate(good.parallel, good_model.config, 4), 4, good_model))
    from transformers import AutoConfig

    gpt2 = meta_model(AutoConfig.for_model("gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    with pytest.raises(ConfigError, match="gpt2"):
        engine.validate(good.parallel, gpt2.config, 4, model=gpt2)


def test_timing_marks_are_written_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "timings.jsonl"
    monkeypatch.delenv("ULTRASCALE_TIMINGS", raising=False)
    ultrascale_plugins._timing_mark("nothing")
    assert not path.exists()
    monkeypatch.setenv("ULTRASCALE_TIMINGS", str(path))
    monkeypatch.setenv("RANK", "3")
    ultrascale_plugins._timing_mark("a")
    ultrascale_plugins._timing_mark("b")
    marks = [json.loads(line) for line in path.read_text().splitlines()]
    assert [m["phase"] for m in marks] == ["a", "b"]
    assert all(m["rank"] == "3" and m["pid"] == os.getpid() and m["t"] > 0 and m["cpu"] >= 0 for m in marks)


def test_the_exit_hook_is_registered_once(monkeypatch):
    import atexit
    import gc

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(ultrascale_plugins, "_freezing_at_exit", False)
    ultrascale_plugins._freeze_at_exit()
    ultrascale_plugins._freeze_at_exit()
    assert registered == [gc.freeze]


def test_the_package_imports_torch_only_when_asked():
    code = ("import sys, ultrascale_plugins\n"
            "assert 'torch' not in sys.modules, 'import ultrascale_plugins pulled in torch'\n"
            "from ultrascale_plugins import init_distributed\n"
            "assert 'torch' in sys.modules and init_distributed.__module__ == 'ultrascale_plugins.distributed.launch'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr

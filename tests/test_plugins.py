"""The pluggy spine: built-ins are plugins, third parties join through the same hooks or the entry point."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pluggy
import pytest
import torch
import torch.distributed as dist

import ultrascale_plugins as us
from models import make_model, padded_batches
from ultrascale_plugins import hookimpl
from ultrascale_plugins.core.registry import BUILTIN_PLUGINS, Registry
from ultrascale_plugins.interface import hookspecs

OUTSIDE = Path(__file__).parent / "outside_plugin"  # a plugin package outside ultrascale-plugins


@pytest.fixture
def single_process():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_builtins_are_registered_as_plugins():
    names = {row["name"]: row for row in us.list_plugins()}
    for builtin in BUILTIN_PLUGINS:
        assert builtin in names
        assert names[builtin]["source"] == "builtin"
    assert "ultrascale_transform_stages" in names["ultrascale_plugins.dims.tensor.plugin"]["hooks"]
    assert [f.name for f in names["ultrascale_plugins.dims.tensor.plugin"]["fields"]] == ["tp", "sequence_parallel",
                                                                                  "loss_parallel"]


def test_every_hook_is_implemented_by_a_builtin():
    """A hook nothing implements is decoration."""
    specs = {name for name in dir(hookspecs) if name.startswith("ultrascale_")}
    implemented = {row_hook for row in us.list_plugins() if row["source"] == "builtin" for row_hook in row["hooks"]}
    assert specs - implemented == set()


def test_third_party_stages_run_where_they_declare(single_process):
    """A plugin's stages run where their names say, among the built-ins: a splitting stage first (it returns
    None: the model stays whole), one after "tp" and before "dp", one after "dp"; parity is kept."""
    calls = []

    class Recorder:
        @hookimpl
        def ultrascale_transform_stages(self, config, model_config):
            def record(name, result=None):
                return lambda model, ctx: calls.append(name) or result

            return [us.Stage("rec_last", record("last"), after=("dp",)),
                    us.Stage("rec_between", record("between"), after=("tp",), before=("dp",)),
                    us.Stage("rec_split", record("split"), before=("split",), splits=True),
                    us.Stage("rec_off", record("off"), active=False)]

        @hookimpl
        def ultrascale_declare_mesh_axes(self, config):
            return [us.MeshAxis("expert", 1)]

    us.register(Recorder(), name="recorder")
    try:
        pmodel = us.parallelize(make_model("llama"), us.ParallelConfig())
        assert calls == ["split", "between", "last"]
        batch = padded_batches(1)[0]
        ref = make_model("llama")(**batch).loss
        assert torch.allclose(pmodel.train_step(batch), ref, atol=1e-6)
    finally:
        us.unregister(name="recorder")


def test_every_hookspec_is_typed():
    """Every argument and every result of every hook has a declared type."""
    import inspect

    for name in (n for n in dir(hookspecs) if n.startswith("ultrascale_")):
        signature = inspect.signature(getattr(hookspecs, name))
        assert signature.return_annotation is not inspect.Signature.empty, name
        for param in signature.parameters.values():
            assert param.annotation is not inspect.Parameter.empty, (name, param.name)


class _Staged:
    def __init__(self, *stages):
        self.stages = stages

    @hookimpl
    def ultrascale_transform_stages(self, config, model_config):
        return list(self.stages)


def _noop(model, ctx):
    return None


@pytest.mark.parametrize("reverse", [False, True])
def test_stage_order_is_declared_not_registration_order(reverse):
    """The documented example (docs/writing-a-plugin.md): a stage declared after "tp" and before "dp" runs there,
    whichever plugin registered first; the built-ins keep their order around it."""
    from models import make_config
    from ultrascale_plugins.core.engine import stages

    pairs = [("zz_between", _Staged(us.Stage("audit", _noop, after=("tp",), before=("dp",)))),
             ("aa_first", _Staged(us.Stage("first", _noop, before=("split",))))]
    for name, plugin in (reversed(pairs) if reverse else pairs):
        us.register(plugin, name=name)
    try:
        config = us.ParallelConfig(tp=2, dp_shard=2, sequence_parallel=True, zero_stage=3, pp=2)
        names = [s.name for s in stages(config, make_config("llama"), world_size=8) if s.active]
        assert names == ["first", "split", "tp", "audit", "dp"]
        described = us.describe(config, make_config("llama"), world_size=8).split("transforms:\n")[1]
        described = described.split("\n\n")[0].splitlines()
        assert [line.split()[1] for line in described] == names and "(zz_between)" in described[3]
    finally:
        us.unregister(name="zz_between")
        us.unregister(name="aa_first")


def test_a_stages_hook_may_take_only_the_arguments_it_needs():
    from models import make_config
    from ultrascale_plugins.core.engine import stages

    class OnlyConfig:
        @hookimpl
        def ultrascale_transform_stages(self, config):
            return [us.Stage("mine", _noop, after=("split",), active=config.tp > 1)]

    us.register(OnlyConfig(), name="only_config")
    try:
        found = {s.name: s for s in stages(us.ParallelConfig(tp=2), make_config("llama"), world_size=2)}
        assert found["mine"].active and found["mine"].plugin == "only_config"
    finally:
        us.unregister(name="only_config")


@pytest.mark.parametrize("stages, message", [
    ([us.Stage("mine", _noop, after=("tensor_parallel",))],
     "stage 'mine' of bad runs after 'tensor_parallel', which no plugin declares. Fix: use one of"),
    ([us.Stage("a", _noop, after=("b",)), us.Stage("b", _noop, after=("a",))],
     r"the stages 'a' \(bad\), 'b' \(bad\), 'a' \(bad\) each wait for another"),
    ([us.Stage("tp", _noop)], "stage 'tp' is declared by both bad and ultrascale_plugins.dims.tensor.plugin"),
])
def test_a_cycle_an_unknown_or_a_taken_stage_name_is_refused_before_any_process_group(stages, message):
    from models import make_config

    us.register(_Staged(*stages), name="bad")
    try:
        with pytest.raises(us.ConfigError, match=message):
            us.validate(us.ParallelConfig(), make_config("llama"), 1)
        assert not dist.is_initialized()
    finally:
        us.unregister(name="bad")


def test_first_train_step_result_wins_and_wrappers_run_around_it(single_process):
    seen = []

    class CustomStep:
        @hookimpl(tryfirst=True)
        def ultrascale_step_run(self, pmodel, batch):
            return torch.tensor(42.0)

    class Around:
        @hookimpl(wrapper=True)
        def ultrascale_step_run(self, pmodel, batch, loss_scale):
            seen.append("before")
            loss = yield
            seen.append(float(loss))
            return loss * 2

    us.register(Around(), name="around")
    try:
        pmodel = us.parallelize(make_model("llama"), us.ParallelConfig())
        batch = padded_batches(1)[0]
        ref = make_model("llama")(**batch).loss.item()
        assert pmodel.train_step(batch).item() == pytest.approx(2 * ref, abs=1e-5)  # the built-in step, wrapped
        assert seen == ["before", pytest.approx(ref, abs=1e-6)]
        us.register(CustomStep(), name="custom-step")
        assert pmodel.train_step(batch).item() == 84.0
    finally:
        us.unregister(name="custom-step")
        us.unregister(name="around")


def test_a_plugin_field_is_a_layout_field_with_its_checks():
    class Field:
        @hookimpl
        def ultrascale_declare_fields(self, fields):
            fields.add("expert_parallel", int, 1, "experts per group", minimum=1)

    with pytest.raises(us.ConfigError, match="unknown parallel key 'expert_parallel'"):
        us.ParallelConfig(expert_parallel=2)
    us.register(Field(), name="field")
    try:
        assert us.ParallelConfig(expert_parallel=2).expert_parallel == 2
        assert us.ParallelConfig().to_dict()["expert_parallel"] == 1
        with pytest.raises(us.ConfigError, match="expert_parallel=0: must be at least 1"):
            us.ParallelConfig(expert_parallel=0)
    finally:
        us.unregister(name="field")


def test_a_plugin_axis_enters_the_world_size_product():
    class Axis:
        @hookimpl
        def ultrascale_declare_mesh_axes(self, config):
            return [us.MeshAxis("expert", 2, after="cp", before="tp")]

    us.register(Axis(), name="axis")
    try:
        with pytest.raises(us.ConfigError, match=r"world size is 4"):
            us.ParallelConfig(tp=2, dp_shard=2).resolve(4)
        assert us.ParallelConfig(tp=2).resolve(8).dp_shard == 2
        from ultrascale_plugins.interface.parallel_dims import ParallelDims

        dims = ParallelDims(us.ParallelConfig(tp=2).resolve(8), 8)
        assert [a.name for a in dims.live_axes] == ["dp_shard", "expert", "tp"]
        assert [dims.coordinate(r, ("dp_shard",)) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    finally:
        us.unregister(name="axis")


def test_unknown_hook_name_fails_fast():
    class Typo:
        @hookimpl
        def ultrascale_shard_modle(self, model, ctx):
            pass

    with pytest.raises(pluggy.PluginValidationError, match="ultrascale_shard_modle"):
        us.register(Typo(), name="typo")
    us.unregister(name="typo")


def _plugins_cli(**env):
    full = {**os.environ, "PYTHONPATH": f"{OUTSIDE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    return subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "plugins"], capture_output=True,
                          text=True, env=full, timeout=120)


def test_entry_point_plugin_appears_in_cli_with_its_fields():
    out = _plugins_cli()
    assert out.returncode == 0, out.stderr
    assert "acme" in out.stdout and "acme-replicas 0.2.0" in out.stdout
    mine = out.stdout.split("acme-replicas", 1)[1]
    assert "ultrascale_step_shard_batch" in mine and "field acme_dp: int = 1" in mine
    assert "ultrascale_plugins.dims.tensor.plugin" in out.stdout and "field tp: int = 1" in out.stdout


def test_environment_variable_restricts_entry_points():
    out = _plugins_cli(ULTRASCALE_PLUGINS="")
    assert out.returncode == 0, out.stderr
    assert "acme" not in out.stdout
    assert "ultrascale_plugins.dims.tensor.plugin" in out.stdout
    assert "acme" in _plugins_cli(ULTRASCALE_PLUGINS="acme,other").stdout


def test_every_hook_is_in_one_group_and_documented_under_it():
    """hookspecs.GROUPS holds every hook once, in the module's order; docs/writing-a-plugin.md documents each group
    under its own heading, every hook of it there and nowhere else."""
    import re
    from pathlib import Path

    specs = [name for name, _ in sorted(((n, getattr(hookspecs, n)) for n in dir(hookspecs)
                                         if n.startswith("ultrascale_")),
                                        key=lambda item: item[1].__code__.co_firstlineno)]
    grouped = [name for names in hookspecs.GROUPS.values() for name in names]
    assert grouped == specs
    assert list(hookspecs.GROUPS) == ["declare", "validate", "transform", "step", "state", "cost"]
    doc = (Path(__file__).resolve().parent.parent / "docs" / "writing-a-plugin.md").read_text()
    hooks = doc.split("## The hooks\n", 1)[1].split("\n## ", 1)[0]
    sections = dict(re.findall(r"### (\w+)\n(.*?)(?=\n### |\Z)", hooks, re.S))
    assert list(sections) == list(hookspecs.GROUPS)
    for group, names in hookspecs.GROUPS.items():
        for name in names:
            holders = [g for g, text in sections.items() if f"`{name}(" in text]
            assert holders == [group], (name, holders)


def test_the_documented_outside_plugin_is_the_tested_file():
    """The walkthrough's code (docs/writing-a-plugin.md, "An example outside the package: a new dimension, end to
    end") is the outside test plugin's own: each hook it shows is that file's implementation with its decorators,
    line for line, each other statement (the imports) is in the file, its entry point is the .dist-info's, it walks
    the fields, the mesh axis, the batch split, the stages and the estimate, and the file implements a hook of every
    group (the tests that run it: test_outside_plugin, test_lightning, test_accelerate, test_planner). The plugin is
    one folder: the module and its .dist-info, nothing else."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "writing-a-plugin.md").read_text().split("## An example outside the package", 1)[1]
    doc = doc.split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    shown = "\n".join(blocks)
    folder = root / "tests" / "outside_plugin"
    source = (folder / "acme_replicas.py").read_text()

    def segment(text, node):  # a top-level function with its decorators (its @hookimpl, its @step place)
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        return "\n".join(text.splitlines()[start - 1:node.end_lineno])

    defined = {node.name: segment(source, node)
               for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    functions = [node for node in ast.parse(shown).body if isinstance(node, ast.FunctionDef)]
    assert len(functions) >= 3
    for node in functions:
        assert segment(shown, node) == defined.get(node.name), node.name
    for node in ast.parse(shown).body:
        if not isinstance(node, ast.FunctionDef):
            assert ast.get_source_segment(shown, node) in source, ast.get_source_segment(shown, node)
    assert {n.name for n in functions} >= {"ultrascale_declare_fields", "ultrascale_declare_mesh_axes", "ultrascale_step_shard_batch",
                                          "ultrascale_transform_stages", "ultrascale_cost_estimate"}
    assert 'after="dp_replicate", before="dp_shard"' in defined["ultrascale_declare_mesh_axes"]
    entry = re.search(r"```ini\n(.*?)```", doc, re.S).group(1)
    assert entry == (folder / "acme_replicas-0.2.0.dist-info" / "entry_points.txt").read_text()
    assert sorted(p.name for p in folder.iterdir() if p.name != "__pycache__") == [
        "acme_replicas-0.2.0.dist-info", "acme_replicas.py"]
    implemented = {name for name in defined if name.startswith("ultrascale_")}
    for group, names in hookspecs.GROUPS.items():
        assert implemented & set(names), f"the outside plugin implements no '{group}' hook"


def test_describe_says_what_wraps_the_model_before_the_stages():
    """``us.describe(..., model=)`` of a PEFT model: the wrapper's line (its plugin's ``ModelWrapper.describe``)
    comes first, then the same stages as for the plain model; a plain model adds no line."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from models import make_config

    mc = make_config("llama")
    config = us.ParallelConfig(pp=2, tp=2, dp_shard=2)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(mc)
        wrapped = get_peft_model(AutoModelForCausalLM.from_config(mc), LoraConfig(r=4, target_modules=["q_proj"]))
    lines = us.describe(config, mc, model=wrapped).splitlines()
    assert lines[0].startswith(" 0. the model: a PEFT model (LORA r=4) around the LlamaForCausalLM")
    assert lines[0].endswith("(ultrascale_plugins.features.peft.wrapper)")
    assert lines[1:] == us.describe(config, mc).splitlines() == us.describe(config, mc, model=plain).splitlines()


def test_the_documented_layout_facts_hold():
    """docs/writing-a-plugin.md, "What other plugins decided": its example runs, and each fact's documented owner
    is the plugin that declares it and the one that answers it."""
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "writing-a-plugin.md").read_text()
    section = doc.split("## What other plugins decided\n", 1)[1].split("\n## ", 1)[0]
    exec(re.search(r"```python\n(.*?)```", section, re.S).group(1), {})
    owners = {"data parallel": "dims.data_parallel", "tensor parallel": "dims.tensor",
              "activation checkpointing": "features.activation_checkpointing", "float8": "features.float8",
              "chunked loss": "features.chunked_loss", "optimizer in backward": "features.optimizer_in_backward",
              "activation offload": "features.activation_offload", "compile": "features.compile"}
    documented = {flag: owners[owner] for flag, owner in re.findall(r"^\| `(\w+)` \| ([\w ]+) \|", section, re.M)}
    pm = us.get_plugin_manager()
    declared = {name: f.plugin.removeprefix("ultrascale_plugins.").rsplit(".", 1)[0]
                for name, f in pm.fields.facts.items()}
    assert declared == documented
    answered = {}
    for impl in pm.hook.ultrascale_declare_facts.get_hookimpls():
        for flag in impl.function(config=us.ParallelConfig(), degrees={}) or {}:
            answered[flag] = impl.plugin_name.removeprefix("ultrascale_plugins.").rsplit(".", 1)[0]
    assert answered == documented


class _Answers:
    """Answers ``flags``; declares ``own`` ({fact: default}) as its own facts."""

    def __init__(self, own=None, **flags):
        self.own, self.flags = own or {}, flags

    @hookimpl
    def ultrascale_declare_fields(self, fields):
        for name, default in self.own.items():
            fields.fact(name, default, "a third party's fact")

    @hookimpl
    def ultrascale_declare_facts(self, config, degrees):
        return self.flags


def test_a_fact_has_one_owner_the_plugin_that_declares_it():
    """The facts are open: a third party declares one of its own (``fields.fact``) and answers it; answering a fact
    the data-parallel plugin owns, or one nobody declares, is refused naming the plugins; a fact no installed plugin
    declares is no attribute of the facts."""
    from ultrascale_plugins.interface.facts import layout_facts

    config = us.ParallelConfig(dp_shard=2, zero_stage=3)
    assert layout_facts(config).fsdp_shards == 2 and layout_facts(config).degree("dp_shard") == 2
    for flags, words in (({"fsdp_shards": 8}, ["'fsdp_shards'", "ultrascale_plugins.dims.data_parallel.plugin",
                                               "'acme_sharding'"]),
                         ({"params_on_disk": True}, ["'acme_sharding'", "'params_on_disk'", "fsdp_units"])):
        us.register(_Answers(**flags), name="acme_sharding")
        try:
            with pytest.raises(us.ConfigError) as err:
                layout_facts(config)
            assert all(w in str(err.value) for w in words), str(err.value)
        finally:
            us.unregister(name="acme_sharding")
    us.register(_Answers(own={"params_on_disk": False}, params_on_disk=True), name="acme_sharding")
    try:
        facts = layout_facts(config)
        assert facts.params_on_disk is True and facts.fsdp_shards == 2
    finally:
        us.unregister(name="acme_sharding")
    pm = Registry()  # two plugins alone: nobody decides the sharding
    for name in ("features.activation_checkpointing.plugin", "features.float8.plugin"):
        pm.register(importlib.import_module(f"ultrascale_plugins.{name}"), name=name)
    facts = pm.facts(pm.config())
    assert (facts.recompute, facts.float8, facts.degree("dp_shard")) == ("none", "none", 1)
    with pytest.raises(AttributeError, match="no installed plugin declares the layout fact 'fsdp_shards'"):
        facts.fsdp_shards

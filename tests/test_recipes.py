"""The recipes at the top of ``recipes/`` as a user runs them: each passes every pre-launch check; the tiny
mixture-of-experts recipe trains with expert parallelism; a tokenizer made offline by
``recipes/tokenizer/train_tokenizer.py`` trains a model on a chat dataset."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def ultrascale(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("path", TOP_RECIPES, ids=lambda p: p.name)
def test_top_level_recipes_pass_the_checks(path):
    from ultrascale_plugins.cli.main import check_recipe
    from ultrascale_plugins.data.recipe import load_recipe

    check_recipe(load_recipe(str(path)))


def test_the_tiny_moe_recipe_is_there():
    assert (ROOT / "recipes" / "tiny_moe.yaml") in TOP_RECIPES


@pytest.mark.slow
def test_tiny_moe_recipe_trains_with_expert_parallelism(tmp_path):
    metrics = tmp_path / "m.json"
    proc = ultrascale("train", str(ROOT / "recipes" / "tiny_moe.yaml"), "--set", "train.steps=3",
                      "--set", "train.log_every=3", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ep=2" in proc.stdout and "model qwen3_moe" in proc.stdout, proc.stdout
    losses = json.loads(metrics.read_text())["losses"]
    assert len(losses) == 3 and all(0 < v < 10 for v in losses)


@pytest.mark.slow
def test_a_tokenizer_made_offline_trains_a_chat_model(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(60)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = subprocess.run([sys.executable, str(ROOT / "recipes" / "tokenizer" / "train_tokenizer.py"), "sft.jsonl",
                           "tok", "--format", "chat", "--vocab-size", "400"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0 and "400 tokens" in made.stdout, made.stdout + made.stderr[-3000:]
    recipe = {"nproc": 1, "model": {"model_type": "llama", "vocab_size": 400, "hidden_size": 32,
                                    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "num_key_value_heads": 2},
              "data": {"dataset": "sft.jsonl", "format": "chat", "tokenizer": "tok", "seq_len": 32,
                       "cache_dir": str(tmp_path / "cache")},
              "train": {"steps": 2, "global_batch": 2, "log_every": 1}}
    (tmp_path / "sft.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    proc = ultrascale("train", "sft.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "sft.jsonl (chat): 60 samples" in proc.stdout, proc.stdout


def test_recipes_docs_and_tests_name_modules_by_their_current_names():
    """Every dotted ``ultrascale_plugins.…`` name in the recipes, docs, benchmarks, front ends and tests is a module
    of the package or a name one defines: modules that moved (tests/test_module_map.py) leave no stale name behind."""
    import importlib
    import importlib.util
    import re

    dotted = re.compile(r"\bultrascale_plugins(?:\.\w+)+")
    importing = re.compile(r"from (ultrascale_plugins[\w.]*) import \(?([\w, ]+)")
    places = [*(ROOT / "recipes").rglob("*.py"), *(ROOT / "recipes").rglob("*.yaml"), *(ROOT / "docs").glob("*.md"),
              ROOT / "README.md", *(ROOT / "benchmarks").rglob("*.py"), ROOT / "benchmarks" / "README.md",
              *(ROOT / "integrations").glob("*.py"), *(ROOT / "tests").rglob("*.py")]
    package = ROOT / "ultrascale_plugins"
    stale = []
    for path in places:
        for name in sorted(set(dotted.findall(path.read_text()))):
            parts = name.split(".")[1:]
            if parts[:1] == ["integrations"]:
                where, parts = ROOT / "integrations", parts[1:]
                module = "ultrascale_plugins.integrations"
            else:
                where, module = package, "ultrascale_plugins"
            while parts and ((where / parts[0]).is_dir() or (where / f"{parts[0]}.py").is_file()):
                where, module, parts = where / parts[0], f"{module}.{parts[0]}", parts[1:]
            if parts and parts[0] != "py" and not hasattr(importlib.import_module(module), parts[0]):
                stale.append(f"{path.relative_to(ROOT)}: {name}")
        for module, names in importing.findall(path.read_text()):  # each name a from-import takes
            if (ROOT / "integrations").is_dir() and module.startswith("ultrascale_plugins.integrations"):
                continue  # the checkout's stand-in package: checked by tests/test_packaging.py
            for name in (n.split(" as ")[0].strip() for n in names.split(",")):
                imported = importlib.import_module(module)
                if name and not hasattr(imported, name) and not (
                        hasattr(imported, "__path__") and importlib.util.find_spec(f"{module}.{name}")):
                    stale.append(f"{path.relative_to(ROOT)}: from {module} import {name}")
    assert not stale, stale


def test_the_corpus_example_in_the_data_docs_runs():
    text = (ROOT / "docs" / "data.md").read_text()
    section = text[text.index("## The bundled corpus in your own scripts"):]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    scope: dict = {}
    exec(compile(code, "docs/data.md", "exec"), scope)
    batch = next(iter(scope["loader"]))
    assert batch["input_ids"].shape == (4, 64) and scope["model"].config.vocab_size == 256


@pytest.mark.slow
def test_the_trainer_script_trains_as_one_job(tmp_path):
    """``recipes/trainer/finetune.py`` under torchrun with TrainingArguments' defaults: one job of two processes
    (Trainer's summary printed once, by the main process), ZeRO-3 over both."""
    from conftest import torchrun

    proc = torchrun(2, ROOT / "recipes" / "trainer" / "finetune.py", "--set", "dp_shard=2", "--steps", "4",
                    "--output-dir", str(tmp_path / "out"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count("train_runtime") == 1, proc.stdout[-2000:] + proc.stderr[-2000:]

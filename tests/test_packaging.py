"""One install brings everything; integrations/ installs under the ultrascale_plugins namespace only (and a
checkout run from its root imports the same files under the same names); the core imports neither Lightning nor
Accelerate; the Lightning strategy is a plainly defined class, registered in both Lightning packages."""
import ast
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest


def test_integrations_live_under_the_package_namespace(tmp_path):
    module = importlib.import_module("ultrascale_plugins.integrations")
    assert module.__name__ == "ultrascale_plugins.integrations"
    # outside the source tree, no top-level "integrations" is importable
    probe = "import importlib.util as u; print(u.find_spec('integrations'))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.stdout.strip() == "None", out.stdout + out.stderr


def test_console_script_and_data_are_installed():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("ultrascale") == "ultrascale_plugins.cli.main:main"
    from importlib import resources

    data = resources.files("ultrascale_plugins").joinpath("resources")
    assert data.joinpath("corpus.txt").read_bytes()
    assert "parallel:" in data.joinpath("default.yaml").read_text()


# ---- the installed adapters are the real files; the checkout's stand-in is not shipped ---------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_installed_integrations_are_the_real_files(tmp_path):
    # what a user outside the checkout imports: the wheel's ultrascale_plugins/integrations/ is integrations/
    probe = "import ultrascale_plugins.integrations as m; print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr[-3000:]
    installed = Path(out.stdout.strip()).parent
    if "site-packages" not in installed.parts:  # CI's venv lies inside the checkout: test where, not under what
        pytest.skip("an editable install: the package is this checkout")
    assert (installed / "__init__.py").read_text() == (ROOT / "integrations" / "__init__.py").read_text()
    assert {p.name for p in installed.glob("*.py")} == {p.name for p in (ROOT / "integrations").glob("*.py")}


_LIST_AND_IMPORT = """
import importlib, pathlib, pkgutil, sys, warnings
warnings.filterwarnings("ignore")
import ultrascale_plugins as package
root = pathlib.Path(package.__file__).parent
print(root)
print(sorted(str(p.relative_to(root)) for p in root.rglob("*.py")))
failed = []
for info in pkgutil.walk_packages([str(root)], "ultrascale_plugins."):
    try:
        importlib.import_module(info.name)
    except Exception as exc:  # noqa: BLE001
        failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
print(failed)
"""


def installed_modules(tmp_path, env=None):
    """What an install outside the checkout holds: its directory, its modules, the ones that failed to import."""
    env = env or {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", _LIST_AND_IMPORT], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    where, modules, failed = out.stdout.strip().splitlines()[-3:]
    return Path(where), set(ast.literal_eval(modules)), ast.literal_eval(failed)


def test_the_installed_package_holds_and_imports_every_module(tmp_path):
    """Packages are found, not listed (pyproject.toml): every module of the checkout is in the installed package
    (integrations/ as ultrascale_plugins/integrations/), and every one imports there."""
    where, modules, failed = installed_modules(tmp_path)
    if "site-packages" not in where.parts:
        pytest.skip("an editable install: the package is this checkout")
    expected = {str(p.relative_to(CORE)) for p in CORE.rglob("*.py") if "integrations" not in p.relative_to(CORE).parts}
    expected |= {f"integrations/{p.name}" for p in (ROOT / "integrations").glob("*.py")}
    assert modules == expected, (sorted(expected - modules), sorted(modules - expected))
    assert not failed, failed


def test_the_checkout_imports_its_own_integrations_directory():
    # python -c / python -m from the repository root import ultrascale_plugins from the checkout (the tests'
    # subprocesses do), whatever is installed; the adapters must then come from the checkout's integrations/
    probe = ("import ultrascale_plugins, ultrascale_plugins.integrations.layout as m; "
             "print(ultrascale_plugins.__file__); print(m.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    package, layout = map(Path, out.stdout.split())
    assert package == ROOT / "ultrascale_plugins" / "__init__.py"
    assert layout == ROOT / "integrations" / "layout.py"


# ---- the core imports neither Lightning nor Accelerate -------------------------------------------------------

FRAMEWORKS = {"lightning", "pytorch_lightning", "lightning_fabric", "accelerate"}
CORE = ROOT / "ultrascale_plugins"


def _core_modules():
    for path in sorted(CORE.rglob("*.py")):
        if "integrations" not in path.relative_to(CORE).parts:
            yield path


def _imports(path: Path, core: Path = CORE):
    """(line, absolute module name, inside a function?) of every import in the file, importlib calls included."""
    package = ".".join(("ultrascale_plugins", *path.relative_to(core).parent.parts))
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node, in_function):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module, in_function))
            if node.module is None:  # from . import x
                found.extend((node.lineno, f"{module}.{alias.name}", in_function) for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value, in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def test_the_core_imports_no_framework():
    bad = []
    for path in _core_modules():
        rel = path.relative_to(ROOT).as_posix()
        for line, module, in_function in _imports(path):
            top = module.split(".")[0]
            if top in FRAMEWORKS:
                bad.append(f"{rel}:{line}: {module}")
            elif module.startswith("ultrascale_plugins.integrations"):
                # the CLI's accelerate-config / accelerate-launch subcommands use the adapters' layout helpers,
                # imported when the subcommand runs
                if not (rel == "ultrascale_plugins/cli/main.py" and in_function):
                    bad.append(f"{rel}:{line}: {module} (the adapters, outside a CLI subcommand)")
    assert not bad, "imports of Lightning/Accelerate (or of the adapters) in the core:\n" + "\n".join(bad)


def test_the_scan_sees_every_kind_of_import(tmp_path):
    path = tmp_path / "ultrascale_plugins" / "models" / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text("import accelerate\nfrom lightning.pytorch import Trainer\ndef f():\n    import pytorch_lightning\n"
                    "    from ..integrations import lightning\n    importlib.import_module('lightning_fabric')\n"
                    "    from .. import integrations\n")
    assert _imports(path, core=path.parent.parent) == [
        (1, "accelerate", False), (2, "lightning.pytorch", False), (4, "pytorch_lightning", True),
        (5, "ultrascale_plugins.integrations", True), (6, "lightning_fabric", True),
        (7, "ultrascale_plugins", True), (7, "ultrascale_plugins.integrations", True)]


def test_importing_the_core_loads_no_framework():
    probe = """
import json, pkgutil, sys, importlib
import ultrascale_plugins, ultrascale_plugins.core.engine, ultrascale_plugins.cli.main, ultrascale_plugins.cli.train
first = sorted({m.split(".")[0] for m in sys.modules})
modeling = "transformers.modeling_utils" in sys.modules
for info in pkgutil.walk_packages(ultrascale_plugins.__path__, "ultrascale_plugins."):
    if not info.name.startswith("ultrascale_plugins.integrations"):
        importlib.import_module(info.name)
print(json.dumps({"first": first, "modeling": modeling, "all": sorted({m.split(".")[0] for m in sys.modules})}))
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    lightning = {"lightning", "pytorch_lightning", "lightning_fabric"}
    assert not lightning & set(seen["first"]), seen["first"]
    assert not lightning & set(seen["all"]), seen["all"]
    # transformers' modeling code imports accelerate itself when it is installed; the package, imported on its
    # own, does not load transformers' models, so nothing brings accelerate in (the scan above covers our code)
    if not seen["modeling"]:
        assert "accelerate" not in seen["first"], seen["first"]


# ---- the Lightning strategy is a plain class, registered in both Lightning packages ---------------------------

def _check_strategy_module(module, pl_package: str, fabric_package: str):
    strategies = importlib.import_module(f"{pl_package}.strategies")
    precision = importlib.import_module(f"{pl_package}.plugins.precision")
    rank_zero = importlib.import_module(f"{fabric_package}.utilities.rank_zero")
    distributed = importlib.import_module(f"{fabric_package}.utilities.distributed")

    for cls in (module.UltraScaleStrategy, module.UltraScalePrecision):
        assert cls.__module__ == module.__name__
        assert cls.__qualname__ == cls.__name__  # defined at module level, not inside a function
        assert inspect.getsource(cls).startswith(f"class {cls.__name__}(")
        assert getattr(module, cls.__name__) is cls
    assert issubclass(module.UltraScaleStrategy, strategies.ParallelStrategy)
    assert issubclass(module.UltraScalePrecision, precision.Precision)
    # the functions that differ between the packages are this package's own
    assert module.UltraScaleStrategy._rank_zero_only is rank_zero.rank_zero_only
    assert module.UltraScaleStrategy._init_dist_connection is distributed._init_dist_connection
    assert module.UltraScaleStrategy._sync_ddp_if_available is distributed._sync_ddp_if_available
    import ultrascale_plugins as us

    for name in us.get_plugin_manager().presets():
        key = "ultrascale" if name == "default" else f"ultrascale_{name}"
        strategy = strategies.StrategyRegistry.get(key)
        assert type(strategy) is module.UltraScaleStrategy, key
        assert strategy.preset == name
        assert type(strategy.precision_plugin) is module.UltraScalePrecision


def test_lightning_strategy_is_a_plain_class():
    from ultrascale_plugins.integrations import lightning

    assert lightning.UltraScaleStrategy.__module__ == "ultrascale_plugins.integrations.lightning"
    _check_strategy_module(lightning, "lightning.pytorch", "lightning.fabric")


@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None,
                    reason="the standalone pytorch_lightning package is not installed")
def test_pytorch_lightning_strategy_is_a_plain_class():
    import ultrascale_plugins.integrations.lightning  # noqa: F401 - registers the names in both packages
    from ultrascale_plugins.integrations import pytorch_lightning

    assert pytorch_lightning.UltraScaleStrategy.__module__ == "ultrascale_plugins.integrations.pytorch_lightning"
    _check_strategy_module(pytorch_lightning, "pytorch_lightning", "lightning_fabric")


@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None,
                    reason="the standalone pytorch_lightning package is not installed")
def test_one_import_registers_the_names_in_both_packages():
    """The documented import (``integrations.lightning``) registers the names in both packages' registries;
    ``integrations.pytorch_lightning`` alone registers its own."""
    probe = """
import ultrascale_plugins.integrations.lightning
from lightning.pytorch.strategies import StrategyRegistry as A
from pytorch_lightning.strategies import StrategyRegistry as B
print(type(A.get("ultrascale_tp")).__module__, type(B.get("ultrascale_tp")).__module__)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ultrascale_plugins.integrations.lightning",
                                  "ultrascale_plugins.integrations.pytorch_lightning"]


# ---- a user's own script prints nothing of torchao's import --------------------------------------------------------
USER_SCRIPT = """
import logging, sys
{imports}
from transformers import AutoModelForCausalLM, LlamaConfig
AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=2, num_key_value_heads=2, vocab_size=100))
logging.getLogger("torchao").warning("another torchao note")  # the filters drop two notes, nothing else
"""


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed (the float8 extra)")
def test_a_users_script_prints_no_torchao_import_notes(tmp_path):
    """transformers imports torchao with every model; on a CPU machine torchao's import logs that its CUDA
    libraries did not load and torch notes how torchao registers its enums: 3 lines in every process of a user's
    Lightning, Accelerate or Trainer script. Importing a front end drops exactly those notes."""
    def stderr_of(imports: str) -> str:
        proc = subprocess.run([sys.executable, "-c", USER_SCRIPT.format(imports=imports)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    plain = stderr_of("")  # what the same script prints without the package: the notes are there to drop
    assert "Failed to load" in plain or "natively supported" in plain, plain
    quiet = stderr_of("from ultrascale_plugins.integrations.trainer import UltraScaleTrainer")
    assert "Failed to load" not in quiet and "natively supported" not in quiet, quiet
    assert "another torchao note" in quiet, quiet


def test_an_extras_hint_installs_from_anywhere():
    """A hint for a missing extra names the extra's own requirements, read from the installed metadata: `pip install
    "ultrascale-plugins[peft]"` needs the package on an index, which a clone's install is not (issue 47)."""
    from ultrascale_plugins.interface.extras import install_command

    for extra, package in (("peft", "peft>="), ("tensorboard", "tensorboard>="), ("float8", "torchao>="),
                           ("plot", "matplotlib>="), ("trl", "trl")):
        command = install_command(extra)
        assert command.startswith(f'pip install "{package}') and "ultrascale-plugins[" not in command, command
    assert install_command("no-such-extra").startswith('pip install ".[no-such-extra]"')


def test_the_quick_starts_main_job_installs_no_torchao():
    """The README's first command installs what the main job uses, and no extra that brings torchao: with it
    installed, every script that imports transformers before this package prints torchao's import notes (issue 47)."""
    import re

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    first, second = [line for line in block.strip().splitlines() if line.strip()]
    assert "ultrascale train" in first and "pytest" in second
    extras = re.findall(r'\.\[([\w,-]+)\]', first.split("&& ultrascale train")[0])
    requires = metadata.requires("ultrascale-plugins") or []
    assert not any(r.startswith("torchao") and "extra ==" not in r for r in requires)
    brought = [e for group in extras for e in group.split(",")
               if any(r.startswith("torchao") and re.search(rf"""extra == ['"]{e}['"]""", r) for r in requires)]
    assert not brought, f"the quick start's install brings torchao through {brought}"

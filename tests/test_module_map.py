"""The module map (docs/architecture.md) as import rules, read from the source (no imports are run): every module
belongs to one layer of the map's diagram and imports only from its own layer or below; only the dimension plugins
(dims/, models/) import dims/, each dimension family only its own modules; the engine imports no dimension."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ultrascale_plugins"
MAP = ROOT / "docs" / "architecture.md"

# each dimension's modules; a family may import its own modules, never another family's
FAMILIES = {
    "data_parallel": {"dims.data_parallel", "dims.data_parallel_costs"},
    "tensor": {"dims.tensor", "dims.tp_styles", "dims.tp_dry_run", "dims.sequence_parallel", "dims.tp_costs"},
    "pipeline": {"dims.pipeline", "dims.pipeline_split", "dims.pipeline_runtime", "dims.pipeline_costs",
                 "dims.pipeline_timeline"},
    "checkpointing": {"dims.checkpointing", "dims.activation_costs"},
    "context_parallel": {"dims.context_parallel", "dims.cp_layout", "dims.cp_attention", "dims.cp_kernels"},
    "compiling": {"dims.compiling"},
    "float8": {"dims.float8"},
}
LAYERS = ("front ends", "planner", "data", "engine", "dimensions", "ground")  # top to bottom, as in the diagram


def layer_entries() -> dict[str, list[str]]:
    """{layer: its entries (``engine.py``, ``dims/*``, ``integrations/*``)} from the diagram in the map."""
    block = MAP.read_text().split("```", 2)[1]
    out: dict[str, list[str]] = {}
    for line in block.splitlines():
        for layer in LAYERS:
            if line.startswith(layer + " "):
                out[layer] = line[len(layer):].split()
    assert list(out) == list(LAYERS), f"the diagram's layers are {list(out)}"
    return out


def module_name(path: Path) -> str:
    if PACKAGE in path.parents:
        return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return "integrations." + path.stem


def all_modules() -> list[Path]:
    core = [p for p in PACKAGE.rglob("*.py")
            if not {"integrations", "resources"} & set(p.relative_to(PACKAGE).parts)]  # resources/: files, no code
    return sorted(core) + sorted((ROOT / "integrations").glob("*.py"))


def layer_of(name: str, entries: dict[str, list[str]]) -> str | None:
    parts = name.split(".")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    for layer, items in entries.items():
        for item in items:
            if item.endswith("/*") and parts[:1] == [item[:-2]]:
                return layer
            if item.endswith(".py") and parts == item[:-3].split("/"):
                return layer
    return None


def imported(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports (relative imports resolved), module level
    or in functions."""
    base = module_name(path).split(".")[:-1] if path.name != "__init__.py" else module_name(path).split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                target = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
                names = [f"{target}.{a.name}" if target else a.name for a in node.names] + [target]
            elif node.module and node.module.startswith("ultrascale_plugins"):
                target = node.module.removeprefix("ultrascale_plugins").lstrip(".")
                names = [target, *(f"{target}.{a.name}" if target else a.name for a in node.names)]
            else:
                continue
            out.update(n for n in names if n)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("ultrascale_plugins.") for a in node.names
                       if a.name.startswith("ultrascale_plugins."))
    return out


def own_modules(names: set[str], known: set[str]) -> set[str]:
    """The package's modules among ``names`` (dropping imported attributes such as ``config.ConfigError``)."""
    out = set()
    for n in names:
        parts = n.split(".")
        while parts and ".".join(parts) not in known:
            parts = parts[:-1]
        if parts:
            out.add(".".join(parts))
    return out


MODULES = all_modules()
KNOWN = {module_name(p).removesuffix(".__init__") for p in MODULES} | {"dims", "models", "planner", "interface",
                                                                         "checkpoints", "data", "integrations"}


def test_every_module_is_on_the_map():
    entries = layer_entries()
    missing = [module_name(p) for p in MODULES
               if p != PACKAGE / "__init__.py" and layer_of(module_name(p), entries) is None]
    assert not missing, f"modules in no layer of docs/architecture.md: {missing}"


@pytest.mark.parametrize("path", [p for p in MODULES if p != PACKAGE / "__init__.py"], ids=module_name)
def test_a_module_imports_only_its_layer_and_below(path):
    entries = layer_entries()
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    mine = layer_of(module_name(path), entries)
    for target in own_modules(imported(path), KNOWN):
        if target in ("", "__init__") or target in ("dims", "models", "planner", "interface", "checkpoints",
                                                     "data", "integrations"):
            continue
        theirs = layer_of(target, entries)
        assert theirs is not None, f"{module_name(path)} imports {target}, which is on no layer of the map"
        assert rank[theirs] >= rank[mine], \
            f"{module_name(path)} ({mine}) imports {target} ({theirs}), a layer above it"


@pytest.mark.parametrize("path", [p for p in MODULES if not module_name(p).startswith(("dims.", "models."))],
                         ids=module_name)
def test_only_the_dimension_plugins_import_dims(path):
    got = {g for g in own_modules(imported(path), KNOWN) if g == "dims" or g.startswith("dims.")}
    assert not got, f"{module_name(path)} imports {sorted(got)}: reach a dimension through a hook"


@pytest.mark.parametrize("path", [p for p in MODULES if module_name(p).startswith("dims.")], ids=module_name)
def test_a_dimension_family_imports_no_other_family(path):
    name = module_name(path)
    family = next((f for f, mods in FAMILIES.items() if name in mods), None)
    others = set().union(*(mods for f, mods in FAMILIES.items() if f != family))
    got = own_modules(imported(path), KNOWN)
    assert not got & others, f"{name} imports another dimension's module {sorted(got & others)}: use a hook"


def test_modules_have_one_name():
    """No finder keeps names modules had before they moved (0.1.0 has no users to keep them for): the old names do
    not import, and the names the docs promise (``__all__``, the interface modules) do."""
    import importlib

    import ultrascale_plugins

    for old in ("hookspecs", "plugins", "parallel_dims", "checkpoint", "pretrained", "recipe_data", "corpus"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"ultrascale_plugins.{old}")
    for name in ultrascale_plugins.__all__:
        assert getattr(ultrascale_plugins, name) is not None, name
    from ultrascale_plugins.interface.hookspecs import hookimpl  # noqa: F401  (tests/outside_plugin uses these)
    from ultrascale_plugins.interface.parallel_dims import MeshAxis  # noqa: F401

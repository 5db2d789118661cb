"""The module map (docs/architecture.md) as import rules, read from the source (no imports are run): every module
belongs to one layer of the map's diagram and imports only from its own layer or below; only the dimension plugins
(dims/, features/, models/) import a family (a folder under dims/ or features/, read from the tree), each family only
its own modules; the engine imports no family."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ultrascale_plugins"
MAP = ROOT / "docs" / "architecture.md"

# the families: each folder under dims/ and features/ (read from the tree, so a new one is checked the day it lands)
FAMILY_ROOTS = ("dims", "features")
FAMILIES = {f"{root}.{d.name}" for root in FAMILY_ROOTS for d in sorted((PACKAGE / root).iterdir())
            if (d / "__init__.py").is_file()}
LAYERS = ("front ends", "planner", "data", "engine", "dimensions", "ground")  # top to bottom, as in the diagram


def layer_entries() -> dict[str, list[str]]:
    """{layer: its entries (``core/*``, ``dims/*``, ``integrations/*``)} from the diagram in the map."""
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
KNOWN = {module_name(p).removesuffix(".__init__") for p in MODULES} | {"integrations"}
PACKAGES = {name for name in KNOWN if (PACKAGE / name.replace(".", "/") / "__init__.py").is_file()}


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
        if target in ("", "__init__") or target in PACKAGES:
            continue
        theirs = layer_of(target, entries)
        assert theirs is not None, f"{module_name(path)} imports {target}, which is on no layer of the map"
        assert rank[theirs] >= rank[mine], \
            f"{module_name(path)} ({mine}) imports {target} ({theirs}), a layer above it"


def family_of(name: str) -> str | None:
    return next((f for f in FAMILIES if name == f or name.startswith(f + ".")), None)


def test_the_families_are_the_tree():
    assert {"dims.data_parallel", "dims.tensor", "dims.pipeline", "dims.context", "dims.expert", "features.peft",
            "features.routers", "features.float8", "features.compile"} <= FAMILIES, sorted(FAMILIES)
    loose = [module_name(p) for p in MODULES if module_name(p).startswith(tuple(r + "." for r in FAMILY_ROOTS))
             and family_of(module_name(p)) is None and not module_name(p).endswith("__init__")]
    assert not loose, f"modules under dims/ or features/ outside a family's folder: {loose}"


@pytest.mark.parametrize("path", [p for p in MODULES if family_of(module_name(p)) is None
                                  and not module_name(p).startswith("models.")], ids=module_name)
def test_only_the_plugins_import_a_family(path):
    got = {g for g in own_modules(imported(path), KNOWN) if family_of(g)}
    assert not got, f"{module_name(path)} imports {sorted(got)}: reach a dimension or feature through a hook"


@pytest.mark.parametrize("path", [p for p in MODULES if family_of(module_name(p))], ids=module_name)
def test_a_family_imports_no_other_family(path):
    name = module_name(path)
    got = {g for g in own_modules(imported(path), KNOWN) if family_of(g) not in (None, family_of(name))}
    assert not got, f"{name} imports another family's module {sorted(got)}: use a hook or a typed fact"


def test_modules_have_one_name():
    """No finder keeps names modules had before they moved (0.1.0 has no users to keep them for): the old names do
    not import, and the names the docs promise (``__all__``, the interface modules) do."""
    import importlib

    import ultrascale_plugins

    for old in ("hookspecs", "plugins", "parallel_dims", "checkpoint", "pretrained", "recipe_data", "corpus", "engine",
                "train", "recipe", "launch", "step", "dims.tp_styles", "dims.expert_parallel", "models.peft_meta"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"ultrascale_plugins.{old}")
    for name in ultrascale_plugins.__all__:
        assert getattr(ultrascale_plugins, name) is not None, name
    from ultrascale_plugins.interface.hookspecs import hookimpl  # noqa: F401  (tests/outside_plugin uses these)
    from ultrascale_plugins.interface.mesh_axes import MeshAxis  # noqa: F401


def test_the_maps_tree_lists_every_folder_and_module():
    """docs/architecture.md draws the tree: every folder of the package, with each of its modules named on its line."""
    tree = MAP.read_text().split("```", 4)[3]
    drawn, top, current = {}, None, None
    for line in tree.splitlines():
        match = re.match(r"^(  |    )(\w+)/(\s|$)", line)
        if match:
            top = match.group(2) if match.group(1) == "  " else top
            current = match.group(2) if match.group(1) == "  " else f"{top}/{match.group(2)}"
            drawn[current] = line[match.end():]
        elif current and line.startswith("      "):
            drawn[current] += " " + line.strip()
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE}):
        rel = folder.relative_to(PACKAGE).as_posix()
        assert rel in drawn, f"{rel}/ is not drawn in the map's tree"
        for module in folder.glob("*.py"):
            if module.stem != "__init__" and rel != "integrations":
                assert re.search(rf"\b{module.stem}\b", drawn[rel]), f"{rel}/{module.name} is not on its folder's line"


def declared_fields() -> dict[str, str]:
    """{layout field: the family whose plugin declares it} (``fields.add("name", ...)`` in the family's source)."""
    out = {}
    for path in MODULES:
        family = family_of(module_name(path))
        if family:
            out.update({name: family for name in re.findall(r"\bfields\.add\(\s*f?\"(\w+)\"", path.read_text())})
    return out


def field_reads(source: str) -> set[str]:
    """The layout fields a module reads: ``config.<field>`` / ``cfg.<field>`` (``ctx.config.<field>`` too) and
    ``getattr(config, "<field>", ...)``."""
    return (set(re.findall(r"\b(?:config|cfg)\.(\w+)", source))
            | set(re.findall(r"getattr\(\s*(?:\w+\.)*(?:config|cfg)\s*,\s*\"(\w+)\"", source)))


def test_the_families_declare_the_fields():
    fields = declared_fields()
    assert {fields["zero_stage"], fields["tp"], fields["pp"], fields["cp"], fields["ep"], fields["float8"],
            fields["activation_checkpointing"]} == {"dims.data_parallel", "dims.tensor", "dims.pipeline",
                                                    "dims.context", "dims.expert", "features.float8",
                                                    "features.activation_checkpointing"}
    assert field_reads('ctx.config.tp > 1 and getattr(config, "zero_stage", 3) and cfg.pp') == {"tp", "zero_stage",
                                                                                              "pp"}


@pytest.mark.parametrize("path", [p for p in MODULES if family_of(module_name(p))], ids=module_name)
def test_a_family_reads_no_other_familys_fields(path):
    """What another family decided is read from ``layout_facts`` (``interface/facts.py``): a mesh degree by the axis's
    name, or a typed flag its owner answers, never that family's layout fields."""
    mine, fields = family_of(module_name(path)), declared_fields()
    foreign = sorted(f"{name} ({fields[name]})" for name in field_reads(path.read_text())
                     if fields.get(name, mine) != mine)
    assert not foreign, f"{module_name(path)} reads {foreign}: read layout_facts(config) instead"


def import_edges(path: Path) -> dict[str, int]:
    """{module of the package: the first line importing it} for ``path``, imports inside functions counted:
    ``from X import a`` names the module ``X.a`` when there is one, else ``X`` (``__init__``: the package's own
    ``__init__``, e.g. for ``__version__``); relative imports resolved."""
    base = module_name(path).split(".")[:-1]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                target = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module + ".").startswith("ultrascale_plugins."):
                target = node.module.removeprefix("ultrascale_plugins").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                out.setdefault(sub if sub in KNOWN else target or "__init__", node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.name + ".").startswith("ultrascale_plugins."):
                    out.setdefault(alias.name.removeprefix("ultrascale_plugins").lstrip(".") or "__init__",
                                   node.lineno)
    return out


def folder_of(name: str) -> str:
    """A module's folder: a top-level subpackage of the package, ``integrations``, or ``__init__`` (the package's
    own)."""
    return name.split(".")[0]


# Imports that close a loop today, each with what removes it (every other loop fails the tests below, and an
# entry whose import is gone fails test_the_known_loops_are_still_there: take it out).
KNOWN_LOOPS: dict[tuple[str, str], str] = {}


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {module it imports: line}} over the package and integrations/, without ``KNOWN_LOOPS``."""
    graph = {}
    for path in MODULES:
        name = module_name(path).removesuffix(".__init__")
        graph[name] = {t: line for t, line in import_edges(path).items()
                       if t != name and (name, t) not in KNOWN_LOOPS}
    return graph


def test_import_edges_resolve_modules_and_the_package():
    path = PACKAGE / "interface" / "mesh_axes.py"
    assert set(import_edges(path)) >= {"interface.fields"}
    assert import_edges(PACKAGE / "__init__.py").get("interface.config") is not None
    assert "__init__" in import_edges(PACKAGE / "cli" / "loop.py")  # from .. import _timing_mark


def test_the_known_loops_are_still_there():
    stale = [f"{a} -> {b}" for a, b in KNOWN_LOOPS
             if b not in import_edges(next(p for p in MODULES if module_name(p).removesuffix(".__init__") == a))]
    assert not stale, f"KNOWN_LOOPS lists imports that are gone: {stale}"


def test_no_two_modules_import_each_other():
    graph = import_graph()
    loops = sorted(f"{a}:{graph[a][b]} <-> {b}:{graph[b][a]}" for a in graph for b in graph[a]
                   if a < b and a in graph.get(b, {}))
    assert not loops, f"modules that import each other (move what both need below them): {loops}"


def test_no_modules_import_each_other_in_a_circle():
    """No cycle of any length among the package's modules (imports inside functions counted): a longer circle (a
    cost model importing its hardware, which reads a profile that imports the cost model's constants) is a loop
    just the same. Tarjan's strongly connected components over the import graph."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, f"modules that import each other in a circle (move what they share below them): {circles}"


def test_no_folder_imports_a_folder_that_imports_it_back():
    edges: dict[tuple[str, str], list[str]] = {}
    for a, targets in import_graph().items():
        for b, line in targets.items():
            if folder_of(a) != folder_of(b):
                edges.setdefault((folder_of(a), folder_of(b)), []).append(f"{a}:{line} -> {b}")
    back = sorted(f"{x} <-> {y}: {edges[(x, y)] + edges[(y, x)]}" for x, y in edges if x < y and (y, x) in edges)
    assert not back, f"folders that import each other (one of them is the lower layer): {back}"


LONGEST_FUNCTION = 80  # lines, decorators excluded (issue 48: one job per function, its steps read top to bottom)


def long_functions(source: str, limit: int = LONGEST_FUNCTION) -> list[tuple[int, str, int]]:
    """(line, name, lines) of every function and method in ``source`` longer than ``limit`` lines (nested ones
    too), read with ast: from its ``def`` to its last line."""
    return [(node.lineno, node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_over_80_lines():
    assert long_functions("@hookimpl\ndef f():\n" + "    x = 1\n" * 80) == [(2, "f", 81)]
    assert long_functions("class C:\n    def m(self):\n" + "        pass\n" * 79) == []
    paths = sorted(p for p in PACKAGE.rglob("*.py") if "resources" not in p.relative_to(PACKAGE).parts)
    found = [f"{path.relative_to(ROOT)}:{line} {name} ({lines} lines)"
             for path in paths + sorted((ROOT / "integrations").glob("*.py"))
             for line, name, lines in long_functions(path.read_text())]
    assert not found, f"functions over {LONGEST_FUNCTION} lines (split them into steps with names): {found}"


def test_the_interface_imports_only_itself():
    """``interface/`` is the contract a third party reads alone: it imports no module of the package outside it."""
    for path in sorted((PACKAGE / "interface").glob("*.py")):
        outside = {t for t in own_modules(imported(path), KNOWN) if t and not t.startswith("interface")}
        assert not outside, f"interface/{path.name} imports {sorted(outside)}"


def test_the_interface_runs_no_plugin():
    """The interface describes the hooks and the values they speak: it holds no plugin manager and calls no hook
    (the registry, ``core/registry.py``, does)."""
    for path in sorted((PACKAGE / "interface").glob("*.py")):
        text = path.read_text()
        for word in (".hook.", "get_hookimpls", "impl.function", "PluginManager(", "get_plugin_manager"):
            assert word not in text, f"interface/{path.name} uses {word!r}"


# Where the process-wide registry may be reached (``default_registry()``, or ``given_or_default(pm)`` for a caller
# that may give none): the front-end edge, each for the reason given. Below it (the
# engine, the families, the ground), a registry is passed: the one a config was made under, or the caller's.
DEFAULT_REGISTRY_EDGE = {
    "__init__": "the public API: us.get_plugin_manager(), us.register()",
    "cli.main": "the command line",
    "integrations.layout": "Accelerate's keys, read from the environment",
    "integrations.lightning_common": "Lightning's strategy names and presets, the model a LightningModule holds",
    "integrations.accelerate": "the model handed to accelerator.prepare",
    "planner.cost": "a Layout, layout string or CostModel made without a registry (ultrascale plan, the validation "
                    "tables, a Layout made by hand): its _registry_or_default",
    "planner.model_spec": "a model's inventory for ultrascale plan",
    "data.recipe": "the sections of a recipe read from its file",
    "checkpoints.export": "ultrascale export",
    "checkpoints.load": "weights read for a script that gives no registry",
    "interface.config": "ParallelConfig(...) made without a registry (the attribute core.registry sets)",
}


def test_the_default_registry_is_reached_only_at_the_edge():
    calls = {module_name(p).removesuffix(".__init__") or "__init__" for p in MODULES
             if re.search(r"\b(default_registry\(\)|given_or_default\()", p.read_text()) and p.name != "registry.py"}
    calls = {"__init__" if c == "" else c for c in calls}
    assert calls <= set(DEFAULT_REGISTRY_EDGE), f"the default registry reached below the edge: {calls - set(DEFAULT_REGISTRY_EDGE)}"
    assert set(DEFAULT_REGISTRY_EDGE) <= calls, f"stale entries: {set(DEFAULT_REGISTRY_EDGE) - calls}"

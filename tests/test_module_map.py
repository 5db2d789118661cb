"""The module map (docs/architecture.md) as import rules, read from the source (no imports are run):
dimensions talk to each other only through hooks, front ends only through the engine."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ultrascale_plugins"

# each dimension's modules; a family may import its own modules, never another family's
FAMILIES = {
    "data_parallel": {"dims.data_parallel", "dims.data_parallel_costs"},
    "tensor": {"dims.tensor", "dims.tp_styles", "dims.tp_dry_run", "dims.sequence_parallel", "dims.tp_costs"},
    "pipeline": {"dims.pipeline", "dims.pipeline_split", "dims.pipeline_runtime", "dims.pipeline_costs",
                 "dims.pipeline_timeline"},
    "checkpointing": {"dims.checkpointing", "dims.activation_costs"},
    "context_parallel": {"dims.context_parallel", "dims.cp_layout", "dims.cp_attention"},
}
FRONT = {"engine", "cli", "train", "recipe", "hf_module", "checkpoint", "export", "pretrained", "initialize",
         "corpus"}


def imported(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports (relative imports resolved), module level or in functions."""
    parts = path.relative_to(PACKAGE if PACKAGE in path.parents else ROOT / "integrations").with_suffix("").parts
    base = ["integrations" if PACKAGE not in path.parents else None, *parts[:-1]]
    base = [b for b in base if b]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1] if node.level > 1 else base
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


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


CORE = sorted(p for p in PACKAGE.rglob("*.py") if "integrations" not in p.relative_to(PACKAGE).parts)


@pytest.mark.parametrize("path", [p for p in CORE if module_name(p).startswith(("dims.", "models."))],
                         ids=module_name)
def test_dimensions_and_models_import_no_engine_front_end_or_other_dimension(path):
    name = module_name(path)
    family = next((f for f, mods in FAMILIES.items() if name in mods), None)
    others = set().union(*(mods for f, mods in FAMILIES.items() if f != family))
    got = imported(path)
    assert not got & FRONT, f"{name} imports {sorted(got & FRONT)}: a dimension reaches the engine through hooks"
    assert not {g for g in got if g.startswith("integrations")}
    if name.startswith("dims."):
        assert not got & others, f"{name} imports another dimension's module {sorted(got & others)}: use a hook"


def test_engine_imports_no_dimension():
    got = imported(PACKAGE / "engine.py")
    assert not {g for g in got if g.startswith("dims")}, sorted(got)


@pytest.mark.parametrize("path", sorted((ROOT / "integrations").glob("*.py")), ids=lambda p: p.name)
def test_front_ends_reach_dimensions_only_through_the_engine(path):
    got = imported(path)
    assert not {g for g in got if g.startswith("dims")}, f"{path.name}: {sorted(got)}"

"""The public names (docs/python-api.md, "The names the package promises") are listed in one place: each imports,
the root's ``__all__`` is exactly the root's line there, and the docs, the README, the recipes and the outside test
plugin import nothing from the package that the list does not hold."""
import ast
import importlib
import re
from pathlib import Path

import ultrascale_plugins

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "python-api.md"


def promised() -> dict[str, set[str]]:
    """{module: the names promised from it} from the list's code block ("" for ``import module`` itself)."""
    text = API.read_text().split("## The names the package promises", 1)[1]
    block = text.split("```python", 1)[1].split("```", 1)[0]
    out: dict[str, set[str]] = {}
    for node in ast.parse(block).body:
        if isinstance(node, ast.ImportFrom):
            out.setdefault(node.module, set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update({a.name: out.get(a.name, set()) for a in node.names})
    return out


def user_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every package import in the docs' and README's code, the recipes and the outside
    plugin; ``us.NAME`` counts as an import of NAME from the root."""
    found = []
    places = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "recipes").rglob("*.py"),
              *(ROOT / "tests" / "outside_plugin").rglob("*.py")]
    line = re.compile(r"^\s*(from (ultrascale_plugins[\w.]*) import \(?([\w, ]+)|import (ultrascale_plugins[\w.]*))",
                      re.M)
    for path in places:
        text = path.read_text()
        for m in line.finditer(text):
            if m.group(4):
                found.append((path.name, m.group(4), ""))
            else:
                found += [(path.name, m.group(2), n.split(" as ")[0].strip()) for n in m.group(3).split(",")
                          if n.strip()]
        found += [(path.name, "ultrascale_plugins", n) for n in re.findall(r"\bus\.([A-Za-z_]\w*)", text)]
    return found


def test_every_promised_name_imports():
    for module, names in promised().items():
        imported = importlib.import_module(module)
        for name in names:
            assert getattr(imported, name, None) is not None, f"{module}.{name}"


def test_the_roots_all_is_the_promised_root_line():
    assert set(ultrascale_plugins.__all__) - {"__version__"} == promised()["ultrascale_plugins"]


def test_users_import_only_promised_names():
    names = promised()
    stray = [f"{where}: {module} {name}".strip() for where, module, name in user_imports()
             if module not in names or (name and name not in names[module])]
    assert len(user_imports()) > 20
    assert not stray, stray

"""Hook hygiene (issue 48, requirement 7), as pytest's own ``_pytest/hookspec.py`` does it: a third party reads a
hook's contract in its docstring alone. Every hookspec names each parameter as ``:param NAME:`` (in the signature's
order), says what it returns in one ``:return:`` line (``:return: Nothing`` exactly when it is annotated
``-> None``: it acts on its arguments or raises), and says "Stops at the first non-None result." exactly when it is
a ``firstresult`` hook."""
import inspect
import re

from ultrascale_plugins.interface import hookspecs

FIRST_WINS = "Stops at the first non-None result."


def _hookspecs() -> dict:
    return {name: getattr(hookspecs, name) for name in dir(hookspecs) if name.startswith("ultrascale_")}


def _options(function) -> dict | None:
    # pluggy's HookspecMarker stores a spec's options on the function under "<project>_spec"
    return getattr(function, f"{hookspecs.PROJECT}_spec", None)


def _contract_problems(name: str, function) -> list[str]:
    doc = inspect.getdoc(function) or ""
    signature = inspect.signature(function)
    problems = []
    documented = re.findall(r"^:param (\w+):", doc, re.M)
    if documented != list(signature.parameters):
        problems.append(f"{name}: ':param' lines name {documented}, the signature {list(signature.parameters)}")
    returns = re.findall(r"^:return: (.*)$", doc, re.M)
    if len(returns) != 1:
        problems.append(f"{name}: {len(returns)} ':return:' lines, not one")
    elif returns[0].startswith("Nothing") != (signature.return_annotation == "None"):
        problems.append(f"{name}: ':return: {returns[0]}' against the annotation -> {signature.return_annotation}")
    if (FIRST_WINS in doc) != bool(_options(function).get("firstresult")):
        problems.append(f"{name}: firstresult={_options(function).get('firstresult')} but the docstring "
                        f"{'says' if FIRST_WINS in doc else 'does not say'} {FIRST_WINS!r}")
    return problems


def test_every_hook_documents_its_parameters_result_and_first_result_rule():
    specs = _hookspecs()
    assert len(specs) >= 30 and all(_options(f) is not None for f in specs.values())  # the search found the specs
    assert any(_options(f).get("firstresult") for f in specs.values())
    problems = [problem for name, function in specs.items() for problem in _contract_problems(name, function)]
    assert not problems, "\n".join(problems)


def test_the_plugin_guide_marks_every_first_result_hook():
    """docs/writing-a-plugin.md says "first result wins" in the table row of every firstresult hook, so the guide
    does not contradict the hookspecs (a row may list several hooks)."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parent.parent / "docs" / "writing-a-plugin.md").read_text()
    rows = [line for line in guide.splitlines() if line.startswith("| `ultrascale_")]
    unmarked = []
    for name, function in _hookspecs().items():
        if _options(function).get("firstresult"):
            row = next(line for line in rows if f"`{name}(" in line)
            if "first result wins" not in row:
                unmarked.append(name)
    assert not unmarked, unmarked

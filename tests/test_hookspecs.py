"""Hook hygiene (issue 48, requirement 7), as pytest's own ``_pytest/hookspec.py`` does it: a third party reads a
hook's contract in its docstring alone. Every hookspec names each parameter as ``:param NAME:`` (in the signature's
order), says what it returns in one ``:return:`` line (``:return: Nothing`` exactly when it is annotated
``-> None``: it acts on its arguments or raises), and says "Stops at the first non-None result." exactly when it is
a ``firstresult`` hook. Every hookspec is in exactly one of ``GROUPS``. Its annotations resolve
(``typing.get_type_hints``) against the hookspecs' ``TYPE_CHECKING`` imports, which come from ``interface/`` alone:
the engine's objects by their ``interface.protocols`` description, checked here against the engine's classes."""
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
    assert len(specs) >= 20 and all(_options(f) is not None for f in specs.values())  # the search found the specs
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


def test_every_hookspec_is_in_exactly_one_group():
    grouped = [name for names in hookspecs.GROUPS.values() for name in names]
    twice = sorted({name for name in grouped if grouped.count(name) > 1})
    assert not twice, f"hooks in more than one group: {twice}"
    assert sorted(grouped) == sorted(_hookspecs()), "GROUPS and the hookspecs differ"


# ---- the annotations resolve: the hookspecs' against their TYPE_CHECKING imports, the protocols' likewise ----------
def _checking_namespace(module) -> dict:
    """``module``'s globals with its ``if TYPE_CHECKING:`` block run: the names its annotations mean, imported
    exactly as the module writes them (no second list of them here)."""
    import ast

    tree = ast.parse(inspect.getsource(module))
    blocks = [node for node in tree.body if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
              and node.test.id == "TYPE_CHECKING"]
    assert len(blocks) == 1, f"{module.__name__}: one top-level 'if TYPE_CHECKING:' block expected"
    namespace = {"__name__": module.__name__, "__package__": module.__package__}
    exec(compile(ast.Module(body=blocks[0].body, type_ignores=[]), module.__file__, "exec"), namespace)
    return {**vars(module), **namespace}


def test_every_hookspec_annotation_resolves():
    import typing

    namespace = _checking_namespace(hookspecs)
    unresolved = []
    for name, function in _hookspecs().items():
        try:
            hints = typing.get_type_hints(function, globalns=namespace)
        except NameError as error:
            unresolved.append(f"{name}: {error}")
            continue
        missing = set(inspect.signature(function).parameters) - set(hints)
        if missing or "return" not in hints:
            unresolved.append(f"{name}: not annotated: {sorted(missing) + ([] if 'return' in hints else ['return'])}")
    assert not unresolved, "\n".join(unresolved)


def _protocols() -> dict:
    from ultrascale_plugins.interface import protocols

    return {name: cls for name, cls in vars(protocols).items()
            if isinstance(cls, type) and cls.__module__ == protocols.__name__}


def _members(protocol) -> dict:
    """{name: the protocol's own declaration} for every member it lists: annotated attributes (value None),
    methods and properties."""
    members = {name: None for name in protocol.__dict__.get("__annotations__", {})}
    members.update({name: value for name, value in vars(protocol).items()
                    if not name.startswith("_") and (callable(value) or isinstance(value, property))})
    return members


def test_the_protocols_annotations_resolve():
    import typing

    from ultrascale_plugins.interface import protocols

    namespace = _checking_namespace(protocols)
    unresolved = []
    for name, protocol in _protocols().items():
        for target in [protocol, *(m.fget if isinstance(m, property) else m for m in _members(protocol).values() if m)]:
            try:
                typing.get_type_hints(target, globalns=namespace)
            except NameError as error:
                unresolved.append(f"{name}.{getattr(target, '__name__', '')}: {error}")
    assert not unresolved, "\n".join(unresolved)


def _offered(cls) -> set[str]:
    """What instances of ``cls`` have: its (and its bases') attributes, annotated fields, and the ``self.NAME``
    its methods assign."""
    import ast

    names = set(dir(cls))
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    tree = ast.parse(inspect.getsource(cls))
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
              and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Store)}
    return names


def test_the_engines_objects_offer_every_member_their_protocol_lists():
    """Each protocol is a true description of the engine's object: every member it lists exists there, and a
    method listed takes the parameters the protocol says, by the same names."""
    from ultrascale_plugins.checkpoints.export import SavedCheckpoint
    from ultrascale_plugins.core.engine import ParallelContext
    from ultrascale_plugins.core.gradients import GradientReductions
    from ultrascale_plugins.core.outputs import TrainerOutputs
    from ultrascale_plugins.core.parallel_model import ParallelModel
    from ultrascale_plugins.core.plugin_state import PluginState
    from ultrascale_plugins.core.tokens import TokenAccounting
    from ultrascale_plugins.models.plan import ModelPlan

    concrete = {cls.__name__: cls for cls in (SavedCheckpoint, ParallelContext, GradientReductions, TrainerOutputs,
                                              ParallelModel, PluginState, TokenAccounting, ModelPlan)}
    protocols = _protocols()
    assert set(protocols) == set(concrete), "a protocol without its concrete class here (or the reverse)"
    problems = []
    for name, protocol in protocols.items():
        offered = _offered(concrete[name])
        for member, declared in _members(protocol).items():
            if member not in offered:
                problems.append(f"{name}.{member}: not offered by {concrete[name].__module__}.{name}")
            elif callable(declared) and not isinstance(declared, property):
                said = list(inspect.signature(declared).parameters)
                has = list(inspect.signature(getattr(concrete[name], member)).parameters)
                if said != has:
                    problems.append(f"{name}.{member}{tuple(said)}: the engine's takes {tuple(has)}")
    assert not problems, "\n".join(problems)


def test_every_hook_is_named_after_its_group():
    """One naming pattern, pytest's: ``ultrascale_<group>_<what>``, the group being the one GROUPS files it under."""
    from ultrascale_plugins.interface import hookspecs

    for group, names in hookspecs.GROUPS.items():
        for name in names:
            assert name.startswith(f"ultrascale_{group}_"), f"{name} is in the {group} group"


def test_a_hook_with_one_builtin_implementation_says_why_it_is_a_hook():
    """A hook exists because a third party needs it: one the package implements once says that need in its
    docstring ("Why a hook: ..."), and there are at most 8 of them; a family's own needs are its objects'
    methods (a pipeline's ``Runtime`` and ``StepSchedule``, PEFT's ``WrapperLibrary``, the chunked loss's
    ``LossHead``)."""
    import ast
    from pathlib import Path

    from ultrascale_plugins.interface import hookspecs

    root = Path(hookspecs.__file__).resolve().parents[1]
    defined: dict = {}
    for path in [*root.rglob("*.py"), *(root.parent / "integrations").glob("*.py")]:
        if path.name == "hookspecs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("ultrascale_"):
                defined[node.name] = defined.get(node.name, 0) + 1
    once = [n for names in hookspecs.GROUPS.values() for n in names if defined.get(n, 0) == 1]
    for name in once:
        assert "Why a hook: " in (getattr(hookspecs, name).__doc__ or ""), name
    # issue 48: at most 8 such hooks; a family's trio of hooks only it answers is one object's methods
    assert 0 < len(once) <= 8, f"{len(once)} hooks with one built-in implementation: {once}"

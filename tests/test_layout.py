"""The package layout as tests, read from the source with `ast` (nothing is imported):

* the arrows point one way, floor by floor (FLOORS, README "Layout"): a package imports only
  packages on its own floor or below;
* the ground floors hold what several floors use: no module of cli/, target/, drafters/parts/,
  store/ or export/ is used by exactly one upper floor (it lives on that floor); drafters/ itself
  holds only the interface (base.py) and the drafters;
* no import cycles between the project's modules, counting module-level AND function-level imports
  (a function-level import only hides a cycle until the function runs);
* no re-export shims (`noqa: F401` re-exports): a name is imported from the module that defines it;
* no function over 80 lines in decode/ and drafters/; no line of the project's Python (tests
  included) over pyproject's [tool.ruff] line-length; a source file over ~600 lines is a warning
  (split by concept, never to get under a number);
* no module of decode/, data/, train/ uses another module's underscore names (`from m import _x`,
  `m._x`): what another module needs is public, named and documented where it lives.

Imports under `if TYPE_CHECKING:` are not run and do not count. `from pkg import name` counts as an
import of the module pkg.name when that is a module of the project, else of pkg itself.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
# the project's folders (specdistill.<folder>) from the ground up: each imports only its own floor
# and those below (README "Layout"); data flows target -> data -> drafter -> trainer -> decoder
FLOORS = ("cli", "target", "drafters", "store", "export", "data", "decode", "train")
PACKAGES = FLOORS
GROUND = ("cli", "target", "drafters", "store", "export")  # below every job's own floor
UPPER = ("data", "decode", "train")
DIST = "specdistill"  # the one importable name (pyproject's package-dir maps the folders under it)
SOFT_FILE_LINES = 600  # a file this long is a prompt to look (a warning), not a failure
MAX_FUNCTION_LINES = 80
SHORT_FUNCTION_PACKAGES = ("decode", "drafters")
# package -> the project packages it must never import: every floor above it
FORBIDDEN = {p: set(FLOORS[i + 1:]) for i, p in enumerate(FLOORS) if FLOORS[i + 1:]}
# folders whose modules use no other module's underscore names
PRIVATE_NAME_PACKAGES = FLOORS


def module_name(path: Path) -> str:
    """drafters/eagle.py -> drafters.eagle; decode/__init__.py -> decode."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = source_files()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom at any depth (functions, classes, try blocks), skipping the
    bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _from_base(node: ast.ImportFrom, name: str) -> str:
    """The module `from <base> import ...` reads in module `name`, relative imports resolved."""
    base = node.module or ""
    if node.level:  # relative: from . import x / from ..pkg import y
        path = MODULES[name]
        package = f"{DIST}." + (name if path.name == "__init__.py" else name.rpartition(".")[0])
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return base


def imports_of(name: str) -> set[str]:
    """The project modules that module `name` imports (module or function level)."""
    path = MODULES[name]
    bare: set[str] = set()
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _from_base(node, name)
            if base.split(".")[0] in PACKAGES:  # a bare top-level name: shadowable, see below
                bare.add(base)
            base = base.removeprefix(f"{DIST}.")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        for target in targets:
            if isinstance(node, ast.Import) and target.split(".")[0] in PACKAGES:
                bare.add(target)
            target = target.removeprefix(f"{DIST}.")
            while target and target not in MODULES:  # `import a.b.c` where c is not a module
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] in PACKAGES:
                found.add(target)
    found.discard(name)
    BARE[name] = bare
    return found


def _is_private(attr: str) -> bool:
    """_name is a module's own; __dunder__ names are not private."""
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _dotted(node: ast.AST) -> str | None:
    """"a.b.c" for a chain of attribute reads on a name (a, a.b, a.b.c), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else None


def private_uses(name: str, source: str) -> list[str]:
    """Where module `name` (its `source`) uses another project module's underscore name:
    `from specdistill.x.y import _z`, or `m._z` where m names a project module through an import
    (`import specdistill.x.y as m`, `from specdistill.x import y`, `import specdistill.x.y`).
    Attributes of objects (`obj._cache`) are not module names and are not checked."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> the project module it is bound to
    found = []
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            modules.update({a.asname: a.name.removeprefix(f"{DIST}.") for a in node.names
                            if a.asname and a.name.removeprefix(f"{DIST}.") in MODULES})
            continue
        base = _from_base(node, name)
        for alias in node.names:
            full = f"{base}.{alias.name}".removeprefix(f"{DIST}.")
            if full in MODULES:  # `from specdistill.x import y`: y is a module
                modules[alias.asname or alias.name] = full
            elif _is_private(alias.name) and base.removeprefix(f"{DIST}.") in MODULES \
                    and base.removeprefix(f"{DIST}.") != name:
                found.append(f"{name}:{node.lineno}: from {base} import {alias.name}")
    for node in ast.walk(tree):
        owner = _dotted(node.value) if isinstance(node, ast.Attribute) else None
        if owner is None or not _is_private(node.attr):
            continue
        head, _, rest = owner.partition(".")
        module = (modules[head] + (f".{rest}" if rest else "") if head in modules
                  else rest if head == DIST else None)
        if module in MODULES and module != name:
            found.append(f"{name}:{node.lineno}: {owner}.{node.attr}")
    return found


BARE: dict[str, set[str]] = {}  # module -> the bare top-level project names it imports
GRAPH = {name: imports_of(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack, stack, out = set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# -- the checker itself has teeth --------------------------------------------------------------------
def test_the_checker_sees_function_level_and_relative_imports_and_finds_cycles():
    assert len(MODULES) > 30 and "decode.spec" in MODULES and "train.recipe" in MODULES
    assert "drafters.parts.head" in MODULES and "store.rundir" in MODULES
    assert "decode.accept" in GRAPH["decode.spec"]  # a module-level `from decode.accept import`
    assert "train.deepspeed_backend" in GRAPH["train.backends"]  # inside build_backend
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# -- the rules ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    bad = sorted(f"{name} imports {target}" for name, targets in GRAPH.items()
                 if name.split(".")[0] == package
                 for target in targets if target.split(".")[0] in FORBIDDEN[package])
    assert not bad, (f"{package}/ must not import {sorted(FORBIDDEN[package])} (the floors, from the "
                     f"ground up: {' < '.join(FLOORS)}); move the code down a floor or pass "
                     f"what it needs as an argument:\n  " + "\n  ".join(bad))


def test_no_import_cycles():
    found = cycles(GRAPH)
    edges = ["; ".join(f"{m} -> {', '.join(sorted(set(GRAPH[m]) & set(c)))}" for m in c)
             for c in found]
    assert not found, ("import cycles between modules (function-level imports included); break "
                       "each by moving what both sides need into a third module:\n  "
                       + "\n  ".join(edges))


def test_long_source_files_are_a_warning_not_a_failure():
    """File size is a prompt to look, not a rule: split by concept, never to get under a number."""
    import warnings

    for p in MODULES.values():
        if (n := len(p.read_text().splitlines())) > SOFT_FILE_LINES:
            warnings.warn(f"{p.relative_to(ROOT)}: {n} lines; is it still one idea?")


def _importers(name: str) -> set[str]:
    """The project modules that import module `name`."""
    return {user for user, targets in GRAPH.items() if name in targets}


def test_ground_floor_modules_serve_more_than_one_upper_floor():
    """A module of the ground floors imported only by modules of one upper floor belongs on that
    floor (hub.py only served the export job: it lives in train/)."""
    single = sorted(f"{m}: imported only by {f.pop()}/" for m in MODULES
                    if m.split(".")[0] in GROUND and (users := _importers(m))
                    and len(f := {u.split(".")[0] for u in users}) == 1 and next(iter(f)) in UPPER)
    assert not single, "ground-floor modules that serve one upper floor only:\n  " + "\n  ".join(single)


def test_drafters_holds_only_the_interface_and_the_drafters():
    """drafters/*.py is base.py plus one module per registered drafter; their shared parts live in
    drafters/parts/ (README "Layout")."""
    from specdistill.drafters.base import DRAFTERS

    registered = {cls.__module__.rsplit(".", 1)[-1] for cls in DRAFTERS.values()
                  if cls.__module__.startswith(f"{DIST}.drafters.")}
    modules = {p.stem for p in (ROOT / "drafters").glob("*.py")} - {"__init__", "base"}
    assert modules == registered, (f"drafters/ holds modules that register no drafter: "
                                   f"{sorted(modules - registered)}; move them to drafters/parts/")


def test_no_reexport_shims():
    """A name is imported from the module that defines it, not through another one."""
    shims = [f"{p.relative_to(ROOT)}:{n}" for p in MODULES.values()
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "noqa: F401" in line and "re-export" in line]
    assert not shims, "re-export shims:\n  " + "\n  ".join(shims)


PYTHON_FILES = [*MODULES.values(), *(p for d in ("tests", "benchmarks", "launch")  # sources, tests, tools
                                     for p in sorted((ROOT / d).rglob("*.py")))]
ENGINE_NAMES_OF_K = {"speculative_tokens", "num_speculative_tokens"}  # the engines' keys, not ours


def names_of_k(tree: ast.AST) -> list[str]:
    """Python names (variables, arguments, attributes, keywords) spelled as an engine's draft-length key."""
    found = []
    for node in ast.walk(tree):
        name = (node.id if isinstance(node, ast.Name)
                else node.arg if isinstance(node, (ast.arg, ast.keyword))
                else node.attr if isinstance(node, ast.Attribute) else None)
        if name in ENGINE_NAMES_OF_K:
            found.append((node.lineno, name))
    return [f"{name} (line {line})" for line, name in sorted(found)]


def test_the_draft_length_is_k_in_our_names():
    assert names_of_k(ast.parse("f(speculative_tokens=1)\nx.num_speculative_tokens\n"
                                "def g(speculative_tokens): pass")) == [
        "speculative_tokens (line 1)", "num_speculative_tokens (line 2)", "speculative_tokens (line 3)"]
    assert names_of_k(ast.parse('c = {"speculative_tokens": k}')) == []  # a key others define: fine
    bad = {str(p.relative_to(ROOT)): n for p in PYTHON_FILES
           if (n := names_of_k(ast.parse(p.read_text())))}
    assert not bad, f"name the draft length k (docs/drafters.md 'Names'): {bad}"


def test_no_line_over_the_projects_line_length():
    limit = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]
    assert len(PYTHON_FILES) > 100  # the walk sees the project
    over = [f"{path.relative_to(ROOT)}:{n}: {len(line)} chars"
            for path in PYTHON_FILES for n, line in enumerate(path.read_text().splitlines(), 1)
            if len(line) > limit]
    assert not over, f"lines over {limit} characters (wrap them):\n" + "\n".join(over)


def test_no_long_function_in_decode_and_drafters():
    long = []
    for name, path in MODULES.items():
        if name.split(".")[0] not in SHORT_FUNCTION_PACKAGES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # decorators excluded, docstring included
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines in "
                      f"{'/, '.join(SHORT_FUNCTION_PACKAGES)}/; split them into named steps:\n  "
                      + "\n  ".join(sorted(long)))


def test_the_project_imports_itself_only_as_specdistill():
    """`from data import x` would find a user's own data/ folder first (python -m train run from
    an ML project's root); every import of the project goes through specdistill.<folder>."""
    bare = sorted(f"{m}: {', '.join(sorted(t))}" for m, t in BARE.items() if t)
    assert not bare, "bare imports of the project's folders (import specdistill.<folder>...):\n  " + \
        "\n  ".join(bare)


def test_the_private_name_checker_sees_every_form():
    """Both import forms and module attributes reached through every kind of import are found; a
    module's own underscore names, dunders and attributes of objects are not."""
    src = ("from specdistill.decode.spec import _Loop, generate\n"
           "import specdistill.decode.evaluate as ev\n"
           "import specdistill.decode.accept\n"
           "from specdistill import data\n"
           "from specdistill.decode import tree\n"
           "from specdistill.decode.batched.spec import _Seq\n"
           "def f(obj):\n"
           "    from specdistill.decode.tree import _local\n"
           "    return (ev._budget, tree._x, specdistill.decode.accept._y, data.prompts._z,\n"
           "            ev.__name__, obj._cache, obj.tree._w)\n")
    got = sorted(use.split(": ", 1)[1] for use in private_uses("decode.batched.spec", src))
    assert got == sorted(["from specdistill.decode.spec import _Loop",
                          "from specdistill.decode.tree import _local", "ev._budget", "tree._x",
                          "specdistill.decode.accept._y", "data.prompts._z"])


@pytest.mark.parametrize("package", PRIVATE_NAME_PACKAGES)
def test_no_module_uses_another_modules_underscore_names(package):
    bad = [use for name, path in MODULES.items() if name.split(".")[0] == package
           for use in private_uses(name, path.read_text())]
    assert not bad, (f"{package}/ uses other modules' underscore names; make what another module "
                     f"needs public (named and documented where it lives), or move it there:\n  "
                     + "\n  ".join(bad))


def test_train_config_plumbing_does_not_reach_into_decode():
    """`python -m train` stores its schemas from drafters/ and train/ (drafters/base.py
    store_drafter_schemas), not through decode/config.py: composing a training config must not
    import the decoder."""
    for name in ("train.__main__", "train.config"):
        assert not {t for t in GRAPH[name] if t.split(".")[0] == "decode"}, GRAPH[name]

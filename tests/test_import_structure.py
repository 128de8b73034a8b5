"""No import circles in deepinfer_core or in any plugin package, and no plugin importing another.

Every import counts: module level, inside functions and under ``TYPE_CHECKING``, because each is a
dependency between the two modules whenever it runs (an import hidden in a function is the same
circle, only discovered later). The scan reads the source (``ast``), never imports it, and
resolves names the way Python does: ``from pkg import name`` depends on ``pkg.name`` when that is
a module, else on ``pkg`` (its ``__init__``); a module does not depend on its parent packages
merely by being inside them. A circle is a strongly connected component of more than one module.

Why: two modules that import each other cannot be understood, tested or replaced one at a time;
when they need each other, one holds a shared type or a registry the other fills (STYLE.md, 9).
``lint-imports`` (``.importlinter``) checks the layers and the plugins' independence in CI; this
test runs with the others and prints each circle with the imports that close it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_PACKAGES = sorted(
    p.parent for pattern in ("plugins/*/deepinfer_*/__init__.py", "tests/fixtures/*/deepinfer_*/__init__.py")
    for p in ROOT.glob(pattern)
)  # fmt: skip
PACKAGES = [ROOT / "deepinfer_core", *PLUGIN_PACKAGES]


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file in ``package`` (``__init__`` names the package)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_names(module: str, path: Path, sources: set[str] | None = None) -> set[str]:
    """Absolute dotted names each import statement of ``module`` refers to, anywhere in the file:
    ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` (a module or a name in ``a``).
    ``sources``, when given, collects the modules the statements import from (``a`` and ``a.b``)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    sources = set() if sources is None else sources
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
            sources |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            sources.add(source)
            names |= {f"{source}.{alias.name}" for alias in node.names if alias.name != "*"}
            if any(alias.name == "*" for alias in node.names):
                names.add(source)
    return names


def resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that ``name`` starts with (``a.b.C`` -> ``a.b``), or None."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph(packages: list[Path]) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (itself excluded)."""
    files = {}
    for package in packages:
        files |= module_files(package)
    known = set(files)
    graph = {}
    for module, path in files.items():
        targets = {resolve(name, known) for name in imported_names(module, path)}
        graph[module] = targets - {None, module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"circle of {len(component)} modules:\n" + "\n".join(edges)


def test_the_scan_sees_every_kind_of_import(tmp_path):
    """The scanner itself: function-level, TYPE_CHECKING and relative imports count, a package's
    ``from . import sibling`` points at the sibling, and circles are found with their members."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nimport pkg.sub\n")
    graph = import_graph([pkg])
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a", "pkg.sub"},
    }
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert "pkg.b -> pkg.sub.c" in describe(circles(graph)[0], graph)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_import_circles(package):
    graph = import_graph([package])
    found = circles(graph)
    assert not found, "\n".join(describe(c, graph) for c in found)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_internal_import_names_a_module_that_exists(package):
    """After a move, an import left pointing at the old place (``from ..layers import`` one level
    too high) fails here, not at the first call of the function that holds it."""
    files = module_files(package)
    missing = []
    for module, path in files.items():
        sources: set[str] = set()
        imported_names(module, path, sources)
        missing += [f"{module}: {s}" for s in sorted(sources) if s.split(".")[0] == package.name and s not in files]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def defined_names(path: Path) -> set[str] | None:
    """Names a module binds at its top level (in ``if`` / ``try`` / ``with`` blocks too); None
    when it defines a module ``__getattr__`` (any name may then resolve)."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text(), str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
    return names


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_name_imported_from_the_package_is_defined_there(package):
    """``from pkg.mod import name`` where ``mod`` no longer defines ``name`` (it moved) fails
    here, also when the import sits in a function that no test calls."""
    files = module_files(package)
    defined = {module: defined_names(path) for module, path in files.items()}
    missing = []
    for module, path in files.items():
        level_base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = level_base[: len(level_base) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            if source not in files or defined[source] is None:
                continue
            missing += [
                f"{module}: {source}.{alias.name}"
                for alias in node.names
                if alias.name != "*" and alias.name not in defined[source] and f"{source}.{alias.name}" not in files
            ]
    assert not missing, "imported names that their module does not define:\n" + "\n".join(missing)


def test_plugins_never_import_each_other_and_core_imports_no_plugin():
    names = {p.name for p in PLUGIN_PACKAGES}
    crossings = []
    for package in PACKAGES:
        for module, path in module_files(package).items():
            for name in imported_names(module, path):
                top = name.split(".")[0]
                if top in names and top != package.name:
                    crossings.append(f"{module} imports {name}")
    assert not crossings, "\n".join(crossings)

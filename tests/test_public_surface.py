"""The public surface for plugin authors (``deepinfer_core.public``): every plugin package imports
only public ``deepinfer_core`` modules and, from them, only names in their ``__all__``; every
public module declares an ``__all__`` whose names exist; the import-linter contract forbids
exactly the internal rest; every plugin in this repository declares the current contract."""

from __future__ import annotations

import ast
import configparser
import importlib
import pkgutil
from pathlib import Path

import pytest

import deepinfer_core
from deepinfer_core import hookspecs
from deepinfer_core.public import PUBLIC_MODULES, TEST_MODULES, internal_roots, is_public

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "deepinfer_core"
# every plugin package in the repository: the four plugins and the third-party fixtures
PLUGIN_PACKAGES = sorted(
    p.parent
    for pattern in ("plugins/*/deepinfer_*/__init__.py", "tests/fixtures/*/deepinfer_*/__init__.py")
    for p in ROOT.glob(pattern)
)


def core_module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def core_imports(path: Path):
    """``(line, module, name or None)`` for each ``deepinfer_core`` import in ``path``, inside
    functions too; ``from deepinfer_core.a import b`` with ``b`` a module gives ``(line, "...a.b",
    None)``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepinfer_core":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "deepinfer_core":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if core_module_exists(sub):
                    yield node.lineno, sub, None
                else:
                    yield node.lineno, node.module, alias.name


def public_names(module: str) -> set[str]:
    return set(importlib.import_module(module).__all__)


def surface_violations(package: Path) -> list[str]:
    problems = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent)
        for line, module, name in core_imports(path):
            if not is_public(module):
                problems.append(f"{where}:{line}: {module} is internal")
            elif name is not None and name not in public_names(module):
                problems.append(f"{where}:{line}: {module}.{name} is not in its __all__")
    return problems


def test_the_plugin_packages_are_found():
    names = {p.name for p in PLUGIN_PACKAGES}
    assert {"deepinfer_cuda_sm100", "deepinfer_ascend950", "deepinfer_3fs", "deepinfer_recipe"} <= names
    assert {"deepinfer_acme", "deepinfer_acme_v1"} <= names


@pytest.mark.parametrize("package", PLUGIN_PACKAGES, ids=lambda p: p.name)
def test_plugin_packages_import_only_the_public_surface(package):
    assert surface_violations(package) == []


@pytest.mark.parametrize("tests", sorted(ROOT.glob("tests/fixtures/*/tests")), ids=lambda p: p.parent.name)
def test_third_party_fixture_tests_use_only_what_plugin_tests_may(tests):
    """The fixtures stand for plugins shipped on their own: their tests may add the engine, the
    host and the server (``TEST_MODULES``) to the public surface, and nothing else."""
    problems = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted(tests.rglob("*.py"))
        for line, module, _ in core_imports(path)
        if not is_public(module, tests=True)
    ]
    assert problems == []


def test_the_scan_sees_imports_inside_functions_and_private_names(tmp_path):
    pkg = tmp_path / "deepinfer_bad"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from deepinfer_core.moe.torch_ref import _scores\n"
        "from deepinfer_core import build_cache, plugin_host\n"
        "def late():\n"
        "    from deepinfer_core.engine import llm_engine\n"
        "    import deepinfer_core.lowbit.native\n"
    )
    assert surface_violations(pkg) == [
        "deepinfer_bad/__init__.py:1: deepinfer_core.moe.torch_ref._scores is not in its __all__",
        "deepinfer_bad/__init__.py:2: deepinfer_core.plugin_host is internal",
        "deepinfer_bad/__init__.py:4: deepinfer_core.engine.llm_engine is internal",
        "deepinfer_bad/__init__.py:5: deepinfer_core.lowbit.native is internal",
    ]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_modules_declare_all_and_every_name_exists(module):
    mod = importlib.import_module(module)
    assert isinstance(getattr(mod, "__all__", None), list), f"{module} has no __all__"
    assert len(set(mod.__all__)) == len(mod.__all__), f"{module}.__all__ repeats a name"
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert missing == [], f"{module}.__all__ names what it does not define"


def test_public_and_test_modules_exist():
    for module in (*PUBLIC_MODULES, *TEST_MODULES):
        assert core_module_exists(module), module


def all_core_modules() -> list[str]:
    names = ["deepinfer_core"]
    for info in pkgutil.walk_packages(deepinfer_core.__path__, "deepinfer_core."):
        names.append(info.name)
    return names


def test_importlinter_contract_forbids_exactly_the_internal_modules():
    config = configparser.ConfigParser()
    assert config.read(ROOT / ".importlinter"), ".importlinter is missing"
    section = config["importlinter:contract:plugins-public-surface"]
    assert section["type"] == "forbidden"
    forbidden = section["forbidden_modules"].split()
    assert forbidden == internal_roots(all_core_modules()), "regenerate: python -m deepinfer_core.public"
    sources = set(section["source_modules"].split())
    roots = set(config["importlinter"]["root_packages"].split())
    assert sources == roots - {"deepinfer_core"}  # every plugin import-linter sees; the AST scan sees all
    assert sources <= {p.name for p in PLUGIN_PACKAGES}


def test_every_plugin_here_declares_the_current_contract():
    """The four plugins and the current fixture are built for this contract; the v1 fixture
    declares none on purpose (it was written for contract 1)."""
    for package in PLUGIN_PACKAGES:
        tree = ast.parse((package / "plugin.py").read_text())
        declared = [
            node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == hookspecs.CONTRACT_ATTRIBUTE for t in node.targets)
        ]
        want = [] if package.name == "deepinfer_acme_v1" else [hookspecs.CONTRACT_VERSION]
        assert declared == want, package.name

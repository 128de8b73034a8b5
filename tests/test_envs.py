"""deepinfer_core/envs.py: one table of every DEEPINFER_* variable, every read through it,
bad values refused in one line naming the variable, and docs/environment.md equal to the table."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core import envs

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "deepinfer_core", *sorted((ROOT / "plugins").glob("*/deepinfer_*"))]


def source_files():
    for top in SOURCES:
        for path in top.rglob("*.py"):
            if "tests" not in path.parts:
                yield path


def test_docs_environment_md_is_the_table():
    doc = ROOT / "docs" / "environment.md"
    assert doc.read_text(encoding="utf-8") == envs.render_markdown(), (
        "docs/environment.md differs from deepinfer_core/envs.py: run python -m deepinfer_core.envs --write"
    )


def test_every_variable_named_in_code_is_in_the_table():
    """Each string constant that is a DEEPINFER_* name (what a read would pass) is declared."""
    declared = {v.name for v in envs.table()}
    named = {}
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value
                if (
                    len(value) > 10
                    and value.startswith("DEEPINFER_")
                    and value.replace("_", "").isalnum()
                    and value.isupper()
                ):
                    named.setdefault(value, str(path.relative_to(ROOT)))
    from deepinfer_core.hookspecs import CONTRACT_ATTRIBUTE

    named.pop(CONTRACT_ATTRIBUTE, None)  # a plugin module's attribute (its contract version), not a variable
    assert {n for n in named if n not in declared} == set(), named
    assert "DEEPINFER_OVERLAP_DEBUG" in declared and len(declared) >= 19


def test_no_module_reads_a_deepinfer_variable_around_the_table():
    """``os.environ.get("DEEPINFER_...")`` / ``os.getenv`` / ``environ[...]`` appear only in envs.py."""
    offenders = []
    for path in source_files():
        if path.name == "envs.py" and path.parent.name == "deepinfer_core":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = {
            t.id: n.value.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            key = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
                if (name == "get" and "environ" in owner) or name == "getenv":
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
                key = node.slice
            if key is None:
                continue
            value = key.value if isinstance(key, ast.Constant) else consts.get(getattr(key, "id", None))
            if isinstance(value, str) and value.startswith("DEEPINFER_"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {value}")
    assert offenders == []


def test_every_entry_is_documented_with_type_default_meaning():
    for var in envs.table():
        assert var.meaning and var.type and var.owner, var
        assert f"`{var.name}`" in envs.render_markdown()


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("DEEPINFER_ADAPTIVE_THREADS", "off", "allowed values are 1 ("),
        ("DEEPINFER_LOWBIT_INT8_ROWS", "-3", "expected a whole number >= 0"),
        ("DEEPINFER_LOWBIT_INT_ROWS", "many", "expected a whole number >= 0"),
        ("DEEPINFER_GGUF_CACHE_MAX_GIB", "lots", "expected a number >= 0"),
        ("DEEPINFER_GGUF_CACHE", "maybe", "allowed values are 1 (on) or 0 (off)"),
        ("DEEPINFER_LOG_LEVEL", "loud", "allowed values are debug, info, warning, error and critical"),
        ("DEEPINFER_PREFILL_ATTENTION", "3", "allowed values are 2 ("),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(name, value, needle):
    with pytest.raises(envs.EnvError) as info:
        envs.get(name, {name: value})
    message = str(info.value)
    assert message.startswith(f"{name}={value!r}: ") and needle in message and "\n" not in message


def test_values_and_defaults():
    assert envs.get("DEEPINFER_ADAPTIVE_THREADS", {}) is True
    assert envs.get("DEEPINFER_ADAPTIVE_THREADS", {"DEEPINFER_ADAPTIVE_THREADS": "0"}) is False
    assert envs.get("DEEPINFER_ADAPTIVE_THREADS", {"DEEPINFER_ADAPTIVE_THREADS": ""}) is True  # empty: unset
    assert envs.get("DEEPINFER_GGUF_CACHE", {"DEEPINFER_GGUF_CACHE": "Off"}) is False
    assert envs.get("DEEPINFER_OVERLAP_DEBUG", {"DEEPINFER_OVERLAP_DEBUG": "1"}) is True
    assert envs.get("DEEPINFER_LOWBIT_INT8_ROWS", {"DEEPINFER_LOWBIT_INT8_ROWS": "16"}) == 16
    assert envs.get("DEEPINFER_GGUF_CACHE_MAX_GIB", {}) == 4.0
    assert envs.get("DEEPINFER_LOG_LEVEL", {"DEEPINFER_LOG_LEVEL": "WARNING"}) == "warning"
    assert envs.get("DEEPINFER_PLUGINS", {}) is None
    assert envs.get("DEEPINFER_PLUGINS", {"DEEPINFER_PLUGINS": "a, b,"}) == ("a", "b")
    assert envs.get("DEEPINFER_PLUGINS", {"DEEPINFER_PLUGINS": ""}) == ()  # set but empty: no plugins
    assert envs.cache_dir({"DEEPINFER_CACHE_DIR": "/x"}) == "/x"
    assert envs.cache_dir({"XDG_CACHE_HOME": "/c"}) == os.path.join("/c", "deepinfer")


def test_the_process_environment_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv("DEEPINFER_LOWBIT_INT8_ROWS", "7")
    assert envs.get("DEEPINFER_LOWBIT_INT8_ROWS") == 7
    monkeypatch.setenv("DEEPINFER_LOWBIT_INT8_ROWS", "9")
    assert envs.get("DEEPINFER_LOWBIT_INT8_ROWS") == 9


def test_a_plugin_declares_and_reads_its_own_variable():
    var = envs.EnvVar("DEEPINFER_TEST_ACME_LEVEL", "int", 3, "an example plugin's setting", owner="acme", minimum=1)
    assert envs.declare(var) is var and envs.declare(var) is var  # idempotent
    try:
        assert envs.get(var.name, {}) == 3 and envs.get(var.name, {var.name: "5"}) == 5
        with pytest.raises(envs.EnvError, match=r"DEEPINFER_TEST_ACME_LEVEL='0': expected a whole number >= 1"):
            envs.get(var.name, {var.name: "0"})
        with pytest.raises(ValueError, match="already declared by acme"):
            envs.declare(envs.EnvVar(var.name, "str", None, "another meaning", owner="other"))
    finally:
        envs._TABLE.pop(var.name)
    with pytest.raises(KeyError, match="not a declared environment variable"):
        envs.get("DEEPINFER_NO_SUCH_THING")


def test_a_bad_value_on_the_command_line_is_one_line():
    env = {**os.environ, "DEEPINFER_LOG_LEVEL": "loud"}
    result = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.entrypoints", "plugins"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "deepinfer plugins: error: DEEPINFER_LOG_LEVEL='loud': allowed values are debug, info, warning, error and "
        "critical"
    ]

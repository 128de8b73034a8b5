"""``deepinfer plugins`` / ``deepinfer version`` through the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = shutil.which("deepinfer", path=str(Path(sys.executable).parent)) or shutil.which("deepinfer")
pytestmark = pytest.mark.skipif(SCRIPT is None, reason="the deepinfer console script is not installed")


def deepinfer(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def broken_distribution(tmp_path) -> Path:
    """A fake installed distribution whose ``deepinfer`` entry point fails to import."""
    dist = tmp_path / "deepinfer_broken_example-0.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: deepinfer-broken-example\nVersion: 0.9\n")
    (dist / "entry_points.txt").write_text("[deepinfer]\nbroken_example = deepinfer_broken_example\n")
    (tmp_path / "deepinfer_broken_example.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file')\n"
    )
    return tmp_path


def test_plugins_table_lists_builtins_as_usable():
    result = deepinfer("plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "CONTRACT", "HOOKS", "USABLE"]
    row = next(line for line in lines if line.startswith("core.platforms"))
    assert "deepinfer-core" in row and "platform,probe" in row and row.rstrip().endswith("yes")
    from deepinfer_core.hookspecs import CONTRACT_VERSION

    assert row.split()[3] == str(CONTRACT_VERSION)  # builtins speak the core's contract


def test_plugins_json_has_every_field():
    result = deepinfer("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    kernels = rows["core.kernels"]
    assert set(kernels) == {
        "name",
        "distribution",
        "version",
        "contract",
        "builtin",
        "hooks",
        "usable",
        "reason",
        "note",
    }
    assert kernels["builtin"] and kernels["usable"]
    assert kernels["contract"] >= 2 and kernels["note"] == ""
    assert sorted(kernels["hooks"]) == ["attention_backend", "moe_dispatcher"]


def test_allow_list_env_hides_installed_plugins():
    rows = json.loads(deepinfer("plugins", "--json", env_extra={"DEEPINFER_PLUGINS": "none-such"}).stdout)
    assert rows and all(r["builtin"] for r in rows)


def test_plugin_that_fails_to_import_is_listed_with_reason(broken_distribution):
    pythonpath = os.pathsep.join(filter(None, [str(broken_distribution), os.environ.get("PYTHONPATH")]))
    result = deepinfer("plugins", "--json", env_extra={"PYTHONPATH": pythonpath})
    assert result.returncode == 0, result.stderr
    row = {r["name"]: r for r in json.loads(result.stdout)}["broken_example"]
    assert row["distribution"] == "deepinfer-broken-example" and row["version"] == "0.9"
    assert row["usable"] is False and "libhccl.so" in row["reason"]
    table = deepinfer("plugins", env_extra={"PYTHONPATH": pythonpath}).stdout
    assert any(line.startswith("broken_example") and "no (import failed" in line for line in table.splitlines())


def test_version():
    result = deepinfer("version")
    assert result.returncode == 0
    from deepinfer_core.builtin import core_version

    assert result.stdout.startswith(f"deepinfer-core {core_version()} ")


def test_unknown_subcommand_fails():
    assert deepinfer("no-such-command").returncode == 2


def test_every_registered_command_is_offered():
    from deepinfer_core.entrypoints.main import COMMANDS

    names = [module.rsplit(".", 1)[1].replace("_", "-") for module in COMMANDS]  # train_drafter -> train-drafter
    assert {"generate", "serve", "plan", "kv", "plugins", "version"} <= set(names)
    listed = deepinfer("--help").stdout
    for name in names:
        assert f"    {name} " in listed or f"    {name}\n" in listed, listed  # a long name wraps its help
        assert deepinfer(name, "--help").returncode == 0, name


@pytest.mark.skipif(
    "DEEPINFER_EXPECT_PLUGINS" not in os.environ, reason="set by each tox env to the plugins it installs"
)
def test_installed_plugins_are_exactly_the_expected_ones():
    """Core alone lists only builtins; each plugin distribution adds exactly its own entry."""
    expected = {name for name in os.environ["DEEPINFER_EXPECT_PLUGINS"].split(",") if name}
    result = deepinfer("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {r["name"] for r in rows if not r["builtin"]} == expected
    assert {r["name"] for r in rows if r["builtin"]} == {
        "core.platforms",
        "core.kernels",
        "core.catalogues",
        "core.lowbit",
    }
    if expected:  # the allow-list filters installed plugins down to the named one
        keep = sorted(expected)[0]
        filtered = json.loads(deepinfer("plugins", "--json", env_extra={"DEEPINFER_PLUGINS": keep}).stdout)
        assert {r["name"] for r in filtered if not r["builtin"]} == {keep}

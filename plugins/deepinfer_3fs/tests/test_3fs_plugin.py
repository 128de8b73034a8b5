"""The plugin's hooks: probe reasons and the ``3fs`` registration through the core host."""

from __future__ import annotations

import sys

import pytest

from deepinfer_3fs import plugin
from deepinfer_3fs.store import MOUNT_ENV, ThreeFSKVStore
from deepinfer_core.kv_store import KVStoreConfig
from deepinfer_core.plugin_host import PluginHost

try:  # Python < 3.12 ships an older importlib.metadata
    import importlib_metadata as metadata
except ImportError:  # pragma: no cover
    from importlib import metadata  # type: ignore[no-redef]


@pytest.fixture
def no_usrbio(monkeypatch):
    monkeypatch.setattr(plugin, "usrbio_importable", lambda: False)


def test_probe_without_mount(monkeypatch, no_usrbio):
    monkeypatch.delenv(MOUNT_ENV, raising=False)
    result = plugin.deepinfer_probe()
    assert not result.usable
    assert result.reason.startswith("no 3FS mount configured (set DEEPINFER_3FS_MOUNT)")
    assert "hf3fs_fuse.io not importable" in result.reason


def test_probe_with_missing_mount(monkeypatch, tmp_path, no_usrbio):
    monkeypatch.setenv(MOUNT_ENV, str(tmp_path / "x"))
    result = plugin.deepinfer_probe()
    assert not result.usable
    assert result.reason.startswith(f"3FS mount {tmp_path / 'x'} does not exist")


def test_probe_with_a_file_as_mount(monkeypatch, tmp_path, no_usrbio):
    (tmp_path / "f").write_text("")
    monkeypatch.setenv(MOUNT_ENV, str(tmp_path / "f"))
    assert plugin.deepinfer_probe().reason.startswith(f"3FS mount {tmp_path / 'f'} is not a directory")


def test_probe_with_a_usable_mount(monkeypatch, tmp_path, no_usrbio):
    monkeypatch.setenv(MOUNT_ENV, str(tmp_path))
    result = plugin.deepinfer_probe()
    assert result.usable, result.reason


def test_usrbio_is_reported_when_importable(monkeypatch, tmp_path):
    package = tmp_path / "site" / "hf3fs_fuse"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "io.py").write_text("def make_iovec(*a):\n    pass\n")
    assert plugin.usrbio_importable() is False  # not on the path yet
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    assert plugin.usrbio_importable() is True
    monkeypatch.setenv(MOUNT_ENV, str(tmp_path))
    assert "USRBIO available" in plugin.deepinfer_probe().reason
    (package / "io.py").write_text("raise ImportError('native client missing')\n")
    assert plugin.usrbio_importable() is False
    assert "hf3fs_fuse" not in sys.modules  # the check never imported it in this process


def test_registration_through_the_plugin_host(monkeypatch, tmp_path):
    monkeypatch.setenv(MOUNT_ENV, str(tmp_path))
    host = PluginHost(load_entry_points=False, extra_plugins={"3fs": plugin})
    assert host.kv_stores()["3fs"] is ThreeFSKVStore
    assert {"memory", "local", "3fs"} <= set(host.kv_stores())
    store = host.open_kv_store("3fs", KVStoreConfig("ns", 64, options={"io": "posix"}))
    assert store.name == "3fs" and store.mount == str(tmp_path)
    info = {p.name: p for p in host.plugins()}["3fs"]
    assert info.usable and "deepinfer_register_kv_stores" in info.hooks


def test_installed_entry_point_names_the_plugin_module():
    eps = [ep for ep in metadata.entry_points(group="deepinfer") if ep.name == "3fs"]
    if not eps:
        pytest.skip("deepinfer-3fs is not installed in this environment")
    assert eps[0].value == "deepinfer_3fs.plugin"
    assert eps[0].load() is plugin

"""A plugin built outside this repository's packages (tests/fixtures/thirdparty_plugin) is found
through its entry point alone and wins over the builtins it replaces.

Runs only where ``deepinfer-acme-example`` is pip-installed (``tox -e thirdparty``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from deepinfer_core.hookspecs import CONTRACT_VERSION

try:
    DIST = metadata.distribution("deepinfer-acme-example")
except metadata.PackageNotFoundError:
    DIST = None
pytestmark = pytest.mark.skipif(DIST is None, reason="pip install tests/fixtures/thirdparty_plugin to run these")

KV = ("deepinfer_register_kv_stores", "register")
VERIFY = ("deepinfer_register_spec_policies", "register_verification")


@pytest.fixture
def host(monkeypatch):
    from deepinfer_core.plugin_host import ALLOW_ENV, PluginHost

    monkeypatch.delenv(ALLOW_ENV, raising=False)
    return PluginHost()  # real entry points, nothing passed in-process


def test_declared_entry_point():
    (ep,) = [ep for ep in DIST.entry_points if ep.group == "deepinfer"]
    assert (ep.name, ep.value) == ("acme", "deepinfer_acme.plugin")


def test_discovered_and_listed(host):
    info = {i.name: i for i in host.plugins()}["acme"]
    assert (info.distribution, info.version, info.builtin) == ("deepinfer-acme-example", DIST.version, False)
    assert info.usable and info.error is None
    assert info.contract == CONTRACT_VERSION  # declared: DEEPINFER_CONTRACT in deepinfer_acme.plugin
    assert set(info.hooks) == {
        "deepinfer_register_kv_stores",
        "deepinfer_register_spec_policies",
        "deepinfer_weight_format",
    }


def test_its_store_replaces_the_builtin_memory_store(host):
    from deepinfer_acme.store import AcmeMemoryStore

    from deepinfer_core.kv_store import KVStore, KVStoreConfig
    from deepinfer_core.kv_store.memory import MemoryKVStore

    assert host.kv_stores()["memory"] is AcmeMemoryStore
    assert host.registry_owner(*KV, "memory") == "acme"
    assert host.registry_owner(*KV, "local") == "core.catalogues"
    store = host.open_kv_store("memory", KVStoreConfig(namespace="ns", block_bytes=8))
    assert isinstance(store, KVStore) and not isinstance(store, MemoryKVStore)


def test_its_policy_replaces_the_builtin_fixed_policy(host):
    import torch

    policy = host.verification_policies()["fixed"]({})
    assert policy.name == "acme-even-split"
    assert host.registry_owner(*VERIFY, "fixed") == "acme"
    assert host.registry_owner(*VERIFY, "confidence") == "core.catalogues"
    assert policy.plan(torch.full((3, 5), 0.5), 7).tolist() == [3, 2, 2]  # builtin would give [5, 2, 0]


def test_allow_list_without_it_restores_the_builtins(monkeypatch):
    from deepinfer_core.kv_store.memory import MemoryKVStore
    from deepinfer_core.plugin_host import ALLOW_ENV, PluginHost

    monkeypatch.setenv(ALLOW_ENV, "some-other-plugin")
    host = PluginHost()
    assert host.kv_stores()["memory"] is MemoryKVStore
    assert host.registry_owner(*KV, "memory") == "core.catalogues"


def test_cli_lists_it():
    script = Path(sys.executable).parent / "deepinfer"
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_PLUGINS"}
    out = subprocess.run([str(script), "plugins", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    row = {r["name"]: r for r in json.loads(out.stdout)}["acme"]
    assert row["distribution"] == "deepinfer-acme-example" and row["usable"]
    assert sorted(row["hooks"]) == ["kv_stores", "spec_policies", "weight_format"]

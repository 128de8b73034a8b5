"""The probe's decisions, with a fake ``torch_npu`` package put on the child's path."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from deepinfer_ascend950 import (
    Ascend950Platform,
    interpret_report,
    plugin,
    run_probe_subprocess,
)
from deepinfer_ascend950 import (
    platform as platform_module,
)
from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.platform import PlatformRequest, ProbeResult, TorchPlatform
from deepinfer_core.plugin_host import NoImplementationError, PluginHost

PLUGIN_ROOT = Path(plugin.__file__).parents[1]
SPEC = AttentionLayerSpec(
    AttentionKind.MLA, 0, num_heads=4, num_kv_heads=1, head_dim=24, v_head_dim=16, scale=0.2, kv_shared=True
)


def fake_torch_npu(
    tmp_path: Path, init: str = "", device_count: int = 1, name: str = "Ascend950PR_9599", version: int = 260
) -> dict:
    """A fake ``torch_npu`` package; returns the env that puts it first on the child's path."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(init) + "\nfrom . import npu\n")
    (pkg / "npu.py").write_text(
        f"def device_count():\n    return {device_count}\n"
        f"def get_device_name(index=0):\n    return {name!r}\n"
        f"def get_soc_version():\n    return {version}\n"
    )
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))


def probe_with(env: dict, **kw) -> ProbeResult:
    return interpret_report(run_probe_subprocess(env=env, **kw))


def test_import_error_without_cann(tmp_path):
    env = fake_torch_npu(tmp_path, init="raise ImportError('libhccl.so: cannot open shared object file')")
    result = probe_with(env)
    assert not result.usable
    assert result.reason == "torch_npu not importable (ImportError: libhccl.so: cannot open shared object file)"


def test_runtime_error_from_backend_autoload(tmp_path):
    env = fake_torch_npu(tmp_path, init="raise RuntimeError('Failed to load the backend extension: torch_npu')")
    result = probe_with(env)
    assert not result.usable and result.reason.startswith("torch_npu not importable (RuntimeError: Failed to load")


def test_child_runs_with_backend_autoload_off(tmp_path):
    init = """
        import os
        if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") != "0":
            raise RuntimeError("autoload was on")
    """
    env = fake_torch_npu(tmp_path, init=init)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "1"
    assert probe_with(env).usable


def test_no_device(tmp_path):
    assert probe_with(fake_torch_npu(tmp_path, device_count=0)) == ProbeResult(False, "no NPU device")


def test_other_soc_is_refused(tmp_path):
    result = probe_with(fake_torch_npu(tmp_path, name="Ascend910B3", version=223))
    assert result == ProbeResult(False, "SoC Ascend910B3 (soc version 223) is not an Ascend 950")


def test_ascend950_is_usable(tmp_path):
    assert probe_with(fake_torch_npu(tmp_path, name="Ascend950DT")) == ProbeResult(True, "Ascend950DT")


def test_hanging_probe_times_out(tmp_path):
    env = fake_torch_npu(tmp_path, init="import time; time.sleep(30)")
    result = probe_with(env, timeout=3)
    assert not result.usable and "timed out" in result.reason


def test_missing_interpreter_is_reported():
    result = interpret_report(run_probe_subprocess(python="/nonexistent/python3"))
    assert not result.usable and "could not start" in result.reason


def test_crashing_child_is_reported(tmp_path):
    env = fake_torch_npu(tmp_path, init="import os; os._exit(3)")
    result = probe_with(env)
    assert not result.usable and "exited 3" in result.reason


def test_this_machine_is_answered_honestly():
    try:
        import importlib.util

        installed = importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        installed = False
    result = Ascend950Platform().probe()
    if not installed:
        assert result.reason.startswith("torch_npu not importable")
    assert "torch_npu" not in sys.modules or result.usable


def test_probe_runs_once_per_platform(monkeypatch):
    calls = []
    monkeypatch.setattr(platform_module, "torch_npu_missing", lambda: None)  # as if installed
    monkeypatch.setattr(platform_module, "run_probe_subprocess", lambda: calls.append(1) or {"import_error": "x"})
    p = Ascend950Platform()
    p.probe(), p.probe()
    assert len(calls) == 1


def test_hooks():
    assert isinstance(plugin.deepinfer_platform(PlatformRequest("npu:1")), Ascend950Platform)
    assert plugin.deepinfer_platform(PlatformRequest("npu:1")).index == 1
    assert isinstance(plugin.deepinfer_platform(PlatformRequest("auto")), Ascend950Platform)
    assert plugin.deepinfer_platform(PlatformRequest("cuda")) is None
    assert plugin.deepinfer_attention_backend(SPEC, TorchPlatform("cpu", "cpu")) is None
    assert plugin.deepinfer_attention_backend(SPEC, TorchPlatform("cuda", "cuda")) is None
    assert isinstance(plugin.deepinfer_attention_backend(SPEC, Ascend950Platform()), plugin.PortableNpuAttention)


def test_host_falls_back_and_explains(monkeypatch):
    monkeypatch.setattr(platform_module, "run_probe_subprocess", lambda: {"import_error": "ImportError: libhccl.so"})
    host = PluginHost(load_entry_points=False, extra_plugins={"ascend950": plugin})
    assert host.platform("auto").name == "cpu"
    with pytest.raises(NoImplementationError, match="torch_npu not importable"):
        host.platform("npu")
    info = {i.name: i for i in host.plugins()}["ascend950"]
    assert not info.usable and info.reason.startswith("torch_npu not importable")
    assert isinstance(host.attention_backend(SPEC, host.platform("cpu")), TorchAttentionBackend)


def test_torch_npu_is_no_dependency():  # nor an extra: test_broken_torch_npu says why
    import tomllib

    project = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())["project"]
    assert not any(re.match(r"torch[-_]npu", dep, re.I) for dep in project["dependencies"])
    assert project["entry-points"]["deepinfer"] == {"ascend950": "deepinfer_ascend950.plugin"}


def test_never_imports_another_plugin():
    for source in (PLUGIN_ROOT / "deepinfer_ascend950").glob("*.py"):
        text = source.read_text()
        assert not re.search(r"^\s*(from|import)\s+deepinfer_(?!core|ascend950)", text, re.M), source.name


def test_missing_torch_npu_is_known_without_a_child(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    monkeypatch.setattr(platform_module, "run_probe_subprocess", lambda: pytest.fail("a child interpreter was started"))
    result = Ascend950Platform().probe()
    assert (
        not result.usable
        and result.reason == "torch_npu not importable (ModuleNotFoundError: No module named 'torch_npu')"
    )

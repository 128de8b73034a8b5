"""The probe and hook logic with the GPU faked: what a user on each kind of machine sees."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.moe import MoESpec, ParallelConfig
from deepinfer_core.platform import PlatformRequest, TorchPlatform
from deepinfer_core.plugin_host import NoImplementationError, PluginHost
from deepinfer_cuda_sm100 import CudaSM100Platform, PortableCudaAttention, plugin, probe_capability

SPEC = AttentionLayerSpec(AttentionKind.FULL, 0, num_heads=2, num_kv_heads=1, head_dim=8, v_head_dim=8, scale=0.3)
PACKAGE = Path(plugin.__file__).parent


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA GPU of the given compute capability is present."""

    def install(capability: tuple[int, int] | None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0 if capability is None else 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return install


@pytest.mark.parametrize(
    "capability, usable, reason",
    [
        (None, False, "no CUDA device"),
        ((7, 5), False, "compute capability 7.5 < 9.0"),
        ((8, 0), False, "compute capability 8.0 < 9.0"),
        ((9, 0), True, "SM90: portable path (native kernels target SM100)"),
        ((10, 0), True, "SM100: native path"),
        ((12, 0), True, "SM120: native path"),
    ],
)
def test_probe_decision(fake_gpu, capability, usable, reason):
    fake_gpu(capability)
    platform = CudaSM100Platform()
    result = platform.probe()
    assert (result.usable, result.reason) == (usable, reason)
    assert plugin.deepinfer_probe() == result
    expected_path = {None: None, (7, 5): None, (8, 0): None, (9, 0): "portable"}.get(capability, "native")
    assert platform.kernel_path() == expected_path


def test_probe_survives_a_broken_driver(monkeypatch):
    def boom():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    assert CudaSM100Platform().probe().reason == "no CUDA device"


def test_pure_decision_function():
    assert probe_capability(True, None).reason == "compute capability unknown"
    assert not probe_capability(False, (10, 0)).usable


def test_this_machine_is_answered_honestly():
    result = CudaSM100Platform().probe()
    if not torch.cuda.is_available():
        assert result.reason == "no CUDA device" and not result.usable


def test_platform_hook_answers_cuda_and_auto_only():
    assert isinstance(plugin.deepinfer_platform(PlatformRequest("cuda")), CudaSM100Platform)
    assert plugin.deepinfer_platform(PlatformRequest("cuda:1")).torch_device() == torch.device("cuda", 1)
    assert isinstance(plugin.deepinfer_platform(PlatformRequest("auto")), CudaSM100Platform)
    assert plugin.deepinfer_platform(PlatformRequest("cpu")) is None
    assert plugin.deepinfer_platform(PlatformRequest("npu")) is None


def test_attention_hook_only_for_cuda_platforms(monkeypatch):
    from deepinfer_cuda_sm100.attention import TritonAttention

    expected = TritonAttention if plugin.triton_available() else PortableCudaAttention
    assert isinstance(plugin.deepinfer_attention_backend(SPEC, CudaSM100Platform()), expected)
    monkeypatch.setattr(plugin, "triton_available", lambda: False)
    assert isinstance(plugin.deepinfer_attention_backend(SPEC, CudaSM100Platform()), PortableCudaAttention)
    assert plugin.deepinfer_moe_dispatcher(MoESpec(0, 4, 2, 8, 8), CudaSM100Platform(), ParallelConfig()) is None
    monkeypatch.undo()
    assert plugin.deepinfer_attention_backend(SPEC, TorchPlatform("cpu", "cpu")) is None
    hca = AttentionLayerSpec(AttentionKind.HEAVILY_COMPRESSED, 0, 2, 1, 8, 8, 0.3, compress_ratio=128)
    assert plugin.deepinfer_attention_backend(hca, CudaSM100Platform()) is None


def test_host_picks_this_plugin_on_sm90_and_falls_back_without_gpu(fake_gpu):
    host = PluginHost(load_entry_points=False, extra_plugins={"cuda_sm100": plugin})
    fake_gpu((9, 0))
    assert isinstance(host.platform("cuda"), CudaSM100Platform)
    assert isinstance(host.platform("auto"), CudaSM100Platform)
    fake_gpu(None)
    host = PluginHost(load_entry_points=False, extra_plugins={"cuda_sm100": plugin})  # probes are cached per host
    assert host.platform("auto").name == "cpu"
    with pytest.raises(NoImplementationError, match="no CUDA device"):
        host.platform("cuda")
    cpu = host.platform("cpu")
    backend = host.attention_backend(SPEC, cpu)
    assert isinstance(backend, TorchAttentionBackend) and not isinstance(backend, PortableCudaAttention)


def test_listed_with_reason_by_the_host(fake_gpu):
    fake_gpu((8, 0))
    host = PluginHost(load_entry_points=False, extra_plugins={"cuda_sm100": plugin})
    info = {i.name: i for i in host.plugins()}["cuda_sm100"]
    assert not info.usable and info.reason == "compute capability 8.0 < 9.0"
    assert {"deepinfer_probe", "deepinfer_platform", "deepinfer_attention_backend", "deepinfer_moe_dispatcher"} <= set(
        info.hooks
    )


def test_never_imports_another_plugin():
    for source in PACKAGE.glob("*.py"):
        text = source.read_text()
        assert not re.search(r"^\s*(from|import)\s+deepinfer_(?!core|cuda_sm100)", text, re.M), source.name


def test_entry_point_when_installed():
    from importlib import metadata

    try:
        dist = metadata.distribution("deepinfer-cuda-sm100")
    except metadata.PackageNotFoundError:
        pytest.skip("deepinfer-cuda-sm100 is not pip-installed")
    (ep,) = [ep for ep in dist.entry_points if ep.group == "deepinfer"]
    assert ep.name == "cuda_sm100" and ep.load() is plugin


def test_import_needs_neither_triton_nor_a_gpu():
    """The CPU-only install: with Triton unimportable the plugin still imports, and its hooks
    fall back to the portable attention and the builtin MoE."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import importlib.util; "
        "importlib.util.find_spec = (lambda f: (lambda n, *a: None if n == 'triton' else f(n, *a)))"
        "(importlib.util.find_spec)\n"
        "from deepinfer_cuda_sm100 import plugin, CudaSM100Platform\n"
        "from deepinfer_core.attention import AttentionKind, AttentionLayerSpec\n"
        "from deepinfer_core.moe import MoESpec, ParallelConfig\n"
        "spec = AttentionLayerSpec(AttentionKind.FULL, 0, 2, 2, 8, 8, 0.3)\n"
        "v4 = AttentionLayerSpec(AttentionKind.SLIDING, 0, 2, 1, 8, 8, 0.3, kv_shared=True, window=4, state_kv=True)\n"
        "print(type(plugin.deepinfer_attention_backend(spec, CudaSM100Platform())).__name__,"
        " type(plugin.deepinfer_attention_backend(v4, CudaSM100Platform())).__name__,"
        " plugin.deepinfer_moe_dispatcher(MoESpec(0, 4, 2, 8, 8), CudaSM100Platform(), ParallelConfig()),"
        " 'triton' in [m for m in sys.modules if sys.modules[m] is not None])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PortableCudaAttention", "PortableCudaV4Attention", "None", "False"]


@pytest.mark.parametrize(
    "kind", [AttentionKind.SLIDING, AttentionKind.COMPRESSED_SPARSE, AttentionKind.HEAVILY_COMPRESSED]
)
def test_deepseek_v4_layers_get_a_backend_with_the_v4_contract(kind):
    """V4 layers (state KV) must not get the paged kernels, which lack ``forward_v4`` (a V4
    model failed to build on the H200 because its sliding layers did): they get the Triton V4
    kernels where Triton is importable, else the portable reference."""
    from deepinfer_cuda_sm100.attention import PortableCudaV4Attention, TritonV4Attention, triton_available

    spec = AttentionLayerSpec(kind, 0, num_heads=2, num_kv_heads=1, head_dim=8, v_head_dim=8, scale=0.3, window=4,
                              compress_ratio=0 if kind is AttentionKind.SLIDING else 4,
                              index_topk=2 if kind is AttentionKind.COMPRESSED_SPARSE else 0, kv_shared=True,
                              state_kv=True)  # fmt: skip
    backend = plugin.deepinfer_attention_backend(spec, CudaSM100Platform())
    assert type(backend) is (TritonV4Attention if triton_available() else PortableCudaV4Attention) and hasattr(
        backend, "forward_v4"
    )

"""The conformance suites, run on this machine: the probe always (it must answer honestly
without a GPU), the device and attention tests wherever a usable CUDA device exists."""

from __future__ import annotations

import pytest

from deepinfer_core.attention import AttentionKind
from deepinfer_core.plugin_host import PluginHost
from deepinfer_core.testing.attention import AttentionBackendSuite
from deepinfer_core.testing.platform import PlatformSuite
from deepinfer_cuda_sm100 import CudaSM100Platform, PortableCudaAttention, plugin


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost(load_entry_points=False, extra_plugins={"cuda_sm100": plugin})


class TestCudaSM100Platform(PlatformSuite):
    @pytest.fixture
    def platform(self):
        return CudaSM100Platform()

    def test_identity(self, platform):
        assert (platform.name, platform.device_type) == ("cuda-sm100", "cuda")


class TestPortableCudaAttention(AttentionBackendSuite):
    supported_kinds = (AttentionKind.FULL, AttentionKind.MLA, AttentionKind.SLIDING)

    @pytest.fixture
    def platform(self):
        return CudaSM100Platform()

    @pytest.fixture
    def backend(self, spec, platform):
        return PortableCudaAttention()  # the Triton backend's suite is in test_triton_attention.py

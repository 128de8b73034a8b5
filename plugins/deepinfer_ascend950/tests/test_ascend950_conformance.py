"""The platform suite on this machine: the probe must answer honestly whatever is installed."""

from __future__ import annotations

import sys

import pytest

from deepinfer_ascend950 import Ascend950Platform, plugin
from deepinfer_core.attention import AttentionKind
from deepinfer_core.plugin_host import PluginHost
from deepinfer_core.testing.attention import AttentionBackendSuite
from deepinfer_core.testing.platform import PlatformSuite


@pytest.fixture(scope="module")
def shared_platform() -> Ascend950Platform:
    return Ascend950Platform()  # one object, so its probe (a child interpreter) runs once


class TestAscend950Platform(PlatformSuite):
    @pytest.fixture
    def platform(self, shared_platform):
        return shared_platform

    def test_identity(self, platform):
        assert (platform.name, platform.device_type) == ("ascend950", "npu")

    def test_probe_does_not_load_torch_npu_here(self, platform):
        platform.probe()
        if not platform.probe().usable:
            assert "torch_npu" not in sys.modules


class TestPortableNpuAttention(AttentionBackendSuite):
    supported_kinds = (AttentionKind.FULL, AttentionKind.MLA, AttentionKind.SLIDING)

    @pytest.fixture
    def platform(self, shared_platform):
        return shared_platform

    @pytest.fixture
    def backend(self, spec, platform):
        host = PluginHost(load_entry_points=False, extra_plugins={"ascend950": plugin})
        backend = host.attention_backend(spec, platform)
        assert isinstance(backend, plugin.PortableNpuAttention)
        return backend

"""The builtins pass every conformance suite, reached through the plugin host as the engine
reaches them (so a broken hook wiring fails here too)."""

from __future__ import annotations

import pytest

from deepinfer_core.attention import AttentionKind
from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.attention.v4_ref import TorchV4AttentionBackend
from deepinfer_core.builtin import catalogues
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher
from deepinfer_core.plugin_host import PluginHost
from deepinfer_core.testing.attention import AttentionBackendSuite, V4AttentionBackendSuite
from deepinfer_core.testing.models import ModelRegistrySuite
from deepinfer_core.testing.moe import MoEDispatcherSuite
from deepinfer_core.testing.platform import PlatformSuite
from deepinfer_core.testing.speculative import VerificationPolicySuite


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost(load_entry_points=False)


class TestCPUPlatform(PlatformSuite):
    @pytest.fixture
    def platform(self, host):
        return host.platform("cpu")

    def test_builtin_cpu_is_usable(self, platform):
        assert platform.name == "cpu" and platform.probe().usable


class TestStockTorchPlatformForAbsentDevice(PlatformSuite):
    """The builtin's fallback for a device type torch knows but this machine lacks must still
    answer its probe honestly."""

    @pytest.fixture
    def platform(self):
        from deepinfer_core.builtin.platforms import deepinfer_platform
        from deepinfer_core.platform import PlatformRequest

        return deepinfer_platform(PlatformRequest("xpu"))


class TestTorchAttention(AttentionBackendSuite):
    supported_kinds = (AttentionKind.FULL, AttentionKind.MLA, AttentionKind.SLIDING)

    @pytest.fixture
    def platform(self, host):
        return host.platform("cpu")

    @pytest.fixture
    def backend(self, spec, platform, host):
        backend = host.attention_backend(spec, platform)
        assert isinstance(backend, TorchAttentionBackend)
        return backend


class TestTorchV4Attention(V4AttentionBackendSuite):
    supported_kinds = (AttentionKind.SLIDING, AttentionKind.COMPRESSED_SPARSE, AttentionKind.HEAVILY_COMPRESSED)

    @pytest.fixture
    def platform(self, host):
        return host.platform("cpu")

    @pytest.fixture
    def backend(self, spec, platform, host):
        backend = host.attention_backend(spec, platform)
        assert isinstance(backend, TorchV4AttentionBackend)
        return backend


class TestTorchMoE(MoEDispatcherSuite):
    @pytest.fixture
    def platform(self, host):
        return host.platform("cpu")

    @pytest.fixture
    def dispatcher(self, spec, platform, host):
        dispatcher = host.moe_dispatcher(spec, platform)
        assert isinstance(dispatcher, TorchMoEDispatcher)
        return dispatcher


class TestFixedVerification(VerificationPolicySuite):
    @pytest.fixture
    def policy(self, host):
        return host.verification_policies()["fixed"]({})

    def test_verifies_requests_in_order(self, policy):
        import torch

        assert policy.plan(torch.full((3, 4), 0.5), 6).tolist() == [4, 2, 0]


class TestConfidenceVerification(VerificationPolicySuite):
    maximises_survival = True

    @pytest.fixture
    def policy(self, host):
        return host.verification_policies()["confidence"]({})


class TestBuiltinModelRegistry(ModelRegistrySuite):
    @pytest.fixture
    def plugin(self):
        return catalogues

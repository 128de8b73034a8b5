"""Conformance suite for platforms (``deepinfer_platform`` / ``deepinfer_probe``).

Subclass :class:`PlatformSuite` and override the ``platform`` fixture::

    class TestMyPlatform(PlatformSuite):
        @pytest.fixture
        def platform(self):
            return MyPlatform()

The probe must answer on every machine (that is what ``deepinfer plugins`` shows), so the probe
tests always run; the device tests run only where the probe says the platform is usable, and
are skipped with the probe's own reason elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from ..platform import Platform, ProbeResult

__all__ = ["PlatformSuite", "usable_device"]


class PlatformSuite:
    """What every :class:`~deepinfer_core.platform.Platform` must do."""

    @pytest.fixture
    def platform(self) -> Platform:
        pytest.fail("a PlatformSuite subclass must override the `platform` fixture")

    @pytest.fixture
    def usable_platform(self, platform: Platform) -> Platform:
        probe = platform.probe()
        if not probe.usable:
            pytest.skip(f"{platform.name} not usable here: {probe.reason}")
        return platform

    # -- always: identity and an honest probe ------------------------------------------------
    def test_is_a_platform(self, platform):
        assert isinstance(platform, Platform)

    def test_name_and_device_type_are_strings(self, platform):
        assert isinstance(platform.name, str) and platform.name
        assert isinstance(platform.device_type, str) and platform.device_type
        assert ":" not in platform.device_type, "device_type is a torch device *type*, without index"

    def test_probe_returns_probe_result(self, platform):
        result = platform.probe()
        assert isinstance(result, ProbeResult)
        assert isinstance(result.usable, bool)
        assert isinstance(result.reason, str)

    def test_unusable_probe_says_why(self, platform):
        result = platform.probe()
        if not result.usable:
            assert result.reason.strip(), "an unusable platform must give a reason"

    def test_probe_is_stable_and_never_raises(self, platform):
        first, second = platform.probe(), platform.probe()
        assert first.usable == second.usable

    def test_capability_is_none_or_int_pair(self, platform):
        cap = platform.capability()
        assert cap is None or (len(cap) == 2 and all(isinstance(x, int) for x in cap))

    # -- where usable: the device really works -----------------------------------------------
    def test_torch_device_allocates(self, usable_platform):
        device = usable_platform.torch_device()
        assert isinstance(device, torch.device)
        assert device.type == usable_platform.device_type
        x = torch.arange(8, dtype=torch.float32, device=device)
        assert x.device.type == usable_platform.device_type
        assert float((x * 2).sum().cpu()) == 56.0

    def test_torch_device_with_index(self, usable_platform):
        device = usable_platform.torch_device(0)
        assert device.type == usable_platform.device_type

    def test_memory_info(self, usable_platform):
        free, total = usable_platform.memory_info()
        assert isinstance(free, int) and isinstance(total, int)
        assert 0 <= free <= total
        assert total > 0

    def test_synchronize(self, usable_platform):
        x = torch.ones(4, device=usable_platform.torch_device())
        y = x + 1
        assert usable_platform.synchronize() is None
        assert torch.equal(y.cpu(), torch.full((4,), 2.0))


def usable_device(platform: Platform) -> torch.device:
    """The platform's torch device, or skip the calling test with the probe's reason."""
    probe = platform.probe()
    if not probe.usable:
        pytest.skip(f"{platform.name} not usable here: {probe.reason}")
    return platform.torch_device()

"""Builtin platforms: the CPU, and stock torch for any other device type it can drive."""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..platform import PlatformRequest, ProbeResult, TorchPlatform


@hookimpl(trylast=True)
def deepinfer_probe() -> ProbeResult:
    return ProbeResult(True)  # the reference path runs wherever torch runs on the CPU


@hookimpl(trylast=True)
def deepinfer_platform(request: PlatformRequest):
    if request.device_type in ("auto", "cpu"):
        return TorchPlatform("cpu", "cpu")
    # Stock torch on other devices (e.g. CUDA without the sm100 plugin): correct, not fast.
    return TorchPlatform(f"torch-{request.device_type}", request.device_type)

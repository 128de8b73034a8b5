"""The hooks of the ``ascend950`` plugin (entry point group ``deepinfer``)."""

from __future__ import annotations

from deepinfer_core.attention import AttentionLayerSpec
from deepinfer_core.attention.torch_ref import SUPPORTED, TorchAttentionBackend
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.platform import Platform, PlatformRequest, ProbeResult

from .platform import Ascend950Platform

DEEPINFER_CONTRACT = 2  # the deepinfer contract version this plugin is built for


class PortableNpuAttention(TorchAttentionBackend):
    """The core's torch reference attention run on the NPU (correct, not fast)."""

    name = "ascend950-portable"


@hookimpl
def deepinfer_probe() -> ProbeResult:
    return Ascend950Platform().probe()


@hookimpl
def deepinfer_platform(request: PlatformRequest) -> Platform | None:
    if request.device_type in ("auto", "npu"):
        return Ascend950Platform(request.index)
    return None


@hookimpl
def deepinfer_attention_backend(layer: AttentionLayerSpec, platform: Platform) -> PortableNpuAttention | None:
    if platform.device_type != "npu" or layer.kind not in SUPPORTED:
        return None
    return PortableNpuAttention()

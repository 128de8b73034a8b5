"""The hooks of the ``cuda_sm100`` plugin (entry point group ``deepinfer``)."""
from __future__ import annotations

from deepinfer_core.attention import AttentionLayerSpec
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.platform import Platform, PlatformRequest, ProbeResult

from .attention import PORTABLE_KINDS, PortableCudaAttention
from .platform import CudaSM100Platform


@hookimpl
def deepinfer_probe() -> ProbeResult:
    return CudaSM100Platform().probe()


@hookimpl
def deepinfer_platform(request: PlatformRequest) -> Platform | None:
    if request.device_type in ("auto", "cuda"):
        return CudaSM100Platform(request.index)
    return None


@hookimpl
def deepinfer_attention_backend(layer: AttentionLayerSpec, platform: Platform) -> PortableCudaAttention | None:
    if platform.device_type != "cuda" or layer.kind not in PORTABLE_KINDS:
        return None
    return PortableCudaAttention()

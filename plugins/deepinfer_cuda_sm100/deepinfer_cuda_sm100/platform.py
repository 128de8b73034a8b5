"""The CUDA platform: stock torch CUDA plus an honest probe of what this GPU can run.

SM100 (Blackwell, capability 10.x) is the target of the native kernels; SM90 (Hopper, 9.x) runs
the portable path; anything older is refused, because the kernels this plugin will ship (FP8
block scales, TMA) do not exist there and the core's builtin torch path serves it anyway.
"""

from __future__ import annotations

from typing import Literal

import torch

from deepinfer_core.platform import ProbeResult, TorchPlatform

MIN_CAPABILITY = (9, 0)
NATIVE_CAPABILITY = (10, 0)

KernelPath = Literal["native", "portable"]


def kernel_path_for(capability: tuple[int, int]) -> KernelPath | None:
    """Which kernels a GPU of this compute capability gets (None: not supported)."""
    if capability >= NATIVE_CAPABILITY:
        return "native"
    if capability >= MIN_CAPABILITY:
        return "portable"
    return None


def probe_capability(available: bool, capability: tuple[int, int] | None) -> ProbeResult:
    """The probe's decision, separated from torch so it can be tested with any GPU faked."""
    if not available:
        return ProbeResult(False, "no CUDA device")
    if capability is None:
        return ProbeResult(False, "compute capability unknown")
    major, minor = capability
    path = kernel_path_for((major, minor))
    if path is None:
        need = ".".join(map(str, MIN_CAPABILITY))
        return ProbeResult(False, f"compute capability {major}.{minor} < {need}")
    if path == "native":
        return ProbeResult(True, f"SM{major}{minor}: native path")
    return ProbeResult(True, f"SM{major}{minor}: portable path (native kernels target SM100)")


class CudaSM100Platform(TorchPlatform):
    """``device_type="cuda"``; the probe checks device presence and compute capability."""

    def __init__(self, index: int | None = None) -> None:
        super().__init__("cuda-sm100", "cuda")
        self.index = index

    def _available(self) -> bool:
        try:
            return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
        except Exception:  # a broken driver reads as "no device", never as a crash
            return False

    def capability(self) -> tuple[int, int] | None:
        if not self._available():
            return None
        try:
            major, minor = torch.cuda.get_device_capability(self.index or 0)
        except Exception:
            return None
        return int(major), int(minor)

    def probe(self) -> ProbeResult:
        available = self._available()
        return probe_capability(available, self.capability() if available else None)

    def kernel_path(self) -> KernelPath | None:
        cap = self.capability()
        return None if cap is None else kernel_path_for(cap)

    def torch_device(self, index: int | None = None) -> torch.device:
        return super().torch_device(self.index if index is None else index)

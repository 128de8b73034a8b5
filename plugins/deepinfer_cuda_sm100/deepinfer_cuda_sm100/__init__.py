"""deepinfer plugin for NVIDIA GPUs (SM100 target, SM90 through the portable path)."""

from __future__ import annotations

from .attention import PortableCudaAttention
from .platform import MIN_CAPABILITY, NATIVE_CAPABILITY, CudaSM100Platform, probe_capability

__all__ = ["CudaSM100Platform", "PortableCudaAttention", "probe_capability", "MIN_CAPABILITY", "NATIVE_CAPABILITY"]
__version__ = "0.1.0"

"""Platforms: the device a model runs on, chosen through ``deepinfer_platform``.

A platform is the only object in the engine allowed to know what kind of hardware it drives
(house rule 6). Everything else asks it for a ``torch.device``, memory figures or a stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["Platform", "PlatformRequest", "ProbeResult", "TorchPlatform"]


@dataclass(frozen=True)
class ProbeResult:
    """Whether something is usable on this machine, and if not, why (human readable)."""

    usable: bool
    reason: str = ""

    def __str__(self) -> str:
        return "yes" if self.usable else f"no: {self.reason}"


@dataclass(frozen=True)
class PlatformRequest:
    """What the user asked for: ``device`` is ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``,
    ``"npu"`` ... The device *type* is the part before the colon."""

    device: str = "auto"

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    def index(self) -> int | None:
        _, _, idx = self.device.partition(":")
        return int(idx) if idx else None


@runtime_checkable
class Platform(Protocol):
    """One kind of device. Returned by ``deepinfer_platform``; called directly by the engine."""

    name: str  # unique, e.g. "cpu", "cuda-sm100"
    device_type: str  # torch device type: "cpu", "cuda", "npu", ...

    def probe(self) -> ProbeResult:
        """Is this platform usable here? Must not raise and must not break the process."""
        ...

    def torch_device(self, index: int | None = None) -> torch.device:
        """The torch device the engine allocates on."""
        ...

    def capability(self) -> tuple[int, int] | None:
        """Compute capability (or vendor equivalent); None where meaningless (CPU)."""
        ...

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of device memory."""
        ...

    def synchronize(self) -> None:
        """Wait for all queued device work."""
        ...


class TorchPlatform:
    """A platform for any device type stock torch drives (cpu, cuda, xpu, mps...).

    The builtin reference platforms are instances of this class; hardware plugins usually
    subclass it and add a stricter probe.
    """

    def __init__(self, name: str, device_type: str) -> None:
        self.name = name
        self.device_type = device_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device_type={self.device_type!r})"

    def _module(self):
        return getattr(torch, self.device_type, None)

    def probe(self) -> ProbeResult:
        if self.device_type == "cpu":
            return ProbeResult(True)
        mod = self._module()
        try:
            available = bool(mod is not None and mod.is_available())
        except Exception as exc:  # a broken driver must not take the process down
            return ProbeResult(False, f"{self.device_type} probe failed: {exc}")
        if not available:
            return ProbeResult(False, f"no {self.device_type.upper()} device")
        return ProbeResult(True)

    def torch_device(self, index: int | None = None) -> torch.device:
        if self.device_type == "cpu" or index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, index)

    def capability(self) -> tuple[int, int] | None:
        mod = self._module()
        if self.device_type == "cpu" or not hasattr(mod, "get_device_capability"):
            return None
        try:
            return tuple(mod.get_device_capability())  # type: ignore[return-value]
        except Exception:
            return None

    def memory_info(self) -> tuple[int, int]:
        if self.device_type == "cpu":
            import os

            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            return int(avail), int(pages)
        free, total = self._module().mem_get_info()
        return int(free), int(total)

    def synchronize(self) -> None:
        mod = self._module()
        if self.device_type != "cpu" and hasattr(mod, "synchronize"):
            mod.synchronize()

"""What the CPU offers for the engine's defaults: native bfloat16 dot products or not.

bfloat16 pays on a CPU only where it has bf16 dot-product instructions (AVX512-BF16 or AMX);
elsewhere torch emulates bf16 matmuls through float32 conversions and they run slower than
float32 itself. torch already probes these (its oneDNN dispatch uses them), so we ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuFeatures:
    capability: str  # torch's kernel dispatch level: DEFAULT, AVX2, AVX512, ...
    avx512_bf16: bool
    amx: bool

    @property
    def native_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx

    @property
    def auto_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.native_bf16 else torch.float32

    def describe(self) -> str:
        """``"AVX2, no AVX512-BF16/AMX: dtype auto -> float32 for dense weights"`` (for dense weights; the line
        ``deepinfer plugins`` prints)."""
        found = [name for name, ok in (("AVX512-BF16", self.avx512_bf16), ("AMX", self.amx)) if ok]
        bf16 = f"native bf16 via {'+'.join(found)}" if found else "no AVX512-BF16/AMX"
        return (
            f"{self.capability}, {bf16}: dtype auto -> {str(self.auto_dtype).removeprefix('torch.')} for dense weights"
        )


def cpu_features() -> CpuFeatures:
    probe = torch.cpu
    return CpuFeatures(
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=bool(getattr(probe, "_is_avx512_bf16_supported", lambda: False)()),
        amx=bool(getattr(probe, "_is_amx_tile_supported", lambda: False)()),
    )


def cpu_summary() -> str:
    """Features and the dtype ``auto`` picks for dense weights (the line ``deepinfer plugins``
    prints under its table). Whether ``auto`` keeps a quantized GGUF's weights packed, and with
    which instruction set, is the ``core.lowbit`` plugin's row of that table (its probe): low-bit
    weights take precedence over the bf16 rule, as they read 4-8x fewer bytes than bf16 weights."""
    return cpu_features().describe()

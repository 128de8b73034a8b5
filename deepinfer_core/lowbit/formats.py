"""GGUF block-quantized tensors -> the two packed formats the kernels read (no float copy).

Both formats keep llama.cpp's blocks of 32 values along the input dimension K, one scale per
block, so the common GGUF types map onto them exactly (bit for bit, after the f16 scales are
widened to f32)::

    q4  qs uint8 [N, K/32, 16]  value j of a block in the low nibble of byte j, value j+16 in
                                the high nibble (ggml's Q4_0/Q4_1 layout);  w = d*q + m
    q8  qs int8  [N, K/32, 32]                                               w = d*q
        d, m float32 [N, K/32]

    Q4_0 -> q4 (m = -8d)   Q4_1 -> q4   Q4_K -> q4 (each 32-value sub-block has its own d, m)
    Q8_0 -> q8             any other type (Q5_*, Q6_K, ...) -> dequantized, then re-quantized
                           to q8 per 32-block (finer than those types, so the error stays small)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32
_EXACT = {"Q4_0", "Q4_1", "Q4_K", "Q8_0"}
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight in one of the packed formats; ``source`` is the GGUF type it came from."""

    kind: str  # "q4" | "q8"
    qs: torch.Tensor
    d: torch.Tensor  # [N, K/32] float32
    m: torch.Tensor | None  # [N, K/32] float32 (q4 only)
    source: str

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qs.shape[0], self.qs.shape[1] * QK)

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        """The same weight with its rows reordered (e.g. the rotary row permutation)."""
        m = None if self.m is None else self.m[index]
        return QuantWeight(self.kind, self.qs[index], self.d[index], m, self.source)

    def dequantize(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 values of all rows, or of ``index``'s rows (embedding lookups): [n, K]."""
        qs, d = (self.qs, self.d) if index is None else (self.qs[index], self.d[index])
        if self.kind == "q8":
            return (qs.float() * d[..., None]).flatten(-2)
        m = self.m if index is None else self.m[index]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [n, K/32, 32]
        return (q * d[..., None] + m[..., None]).flatten(-2)


def quantize_q8(w: torch.Tensor, source: str = "float") -> QuantWeight:
    """Symmetric int8 per 32-block (llama.cpp's Q8_0 rule: d = max|w| / 127, q = round(w / d))."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // QK, QK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    qs = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight("q8", qs, d, None, source)


def from_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
    """Pack one GGUF tensor (``raw`` = its bytes, [N, bytes per row]) of shape [N, K]."""
    n, k = shape
    if k % QK:
        raise ValueError(f"K={k} is not a multiple of {QK}")
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).reshape(n, -1)
    if type_name == "Q8_0":
        b = data.reshape(n, k // QK, 34)
        return QuantWeight("q8", b[..., 2:].contiguous().view(torch.int8), _f16(b[..., 0:2]), None, type_name)
    if type_name == "Q4_0":
        b = data.reshape(n, k // QK, 18)
        d = _f16(b[..., 0:2])
        return QuantWeight("q4", b[..., 2:].contiguous(), d, -8.0 * d, type_name)
    if type_name == "Q4_1":
        b = data.reshape(n, k // QK, 20)
        return QuantWeight("q4", b[..., 4:].contiguous(), _f16(b[..., 0:2]), _f16(b[..., 2:4]), type_name)
    if type_name == "Q4_K":
        return _q4_k(data.reshape(n, k // 256, 144))
    import gguf

    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return quantize_q8(torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(n, k)), type_name)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def _q4_k(b: torch.Tensor) -> QuantWeight:
    """Q4_K super-blocks of 256 (d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles)
    -> 8 q4 blocks each: sub-block s has w = d*sc[s]*q - dmin*mn[s]."""
    n, nsb, _ = b.shape
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [N, nsb]
    sc_bytes = b[..., 4:16].to(torch.int32)  # [N, nsb, 12]
    lo, hi = sc_bytes[..., 0:4], sc_bytes[..., 4:8]
    top = sc_bytes[..., 8:12]
    scales = torch.cat([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], dim=-1).float()  # [N, nsb, 8]
    mins = torch.cat([hi & 63, (top >> 4) | ((hi >> 6) << 4)], dim=-1).float()
    qs = b[..., 16:].reshape(n, nsb, 4, 32)  # chunk c: low nibbles = sub-block 2c, high = 2c+1
    values = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, nsb * 8, 32)  # [N, K/32, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)
    return QuantWeight(
        "q4", packed.contiguous(), (d[..., None] * scales).reshape(n, -1), (-dmin[..., None] * mins).reshape(n, -1), "Q4_K"
    )

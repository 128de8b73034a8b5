"""GGUF block-quantized tensors -> the three packed formats the kernels read (no float copy).

All keep llama.cpp's blocks of 32 values along the input dimension K, one scale per block, so
the common GGUF types map onto them exactly (bit for bit, after the f16 scales are widened to
f32)::

    q4  qs uint8 [N, K/32, 16]  value j of a block in the low nibble of byte j, value j+16 in
                                the high nibble (ggml's Q4_0/Q4_1 layout);  w = d*q + m
    q5  qs uint8 [N, K/32, 20]  q4's 16 bytes (the low 4 bits), then a little-endian uint32
                                whose bit j is bit 4 of value j (ggml's qh);  w = d*q + m
    q8  qs int8  [N, K/32, 32]                                               w = d*q
        d, m float32 [N, K/32]

    Q4_0 -> q4 (m = -8d)   Q4_1 -> q4   Q4_K -> q4 (each 32-value sub-block has its own d, m)
    Q5_0 -> q5 (m = -16d)  Q5_1 -> q5   Q5_K -> q5 (likewise)        Q8_0 -> q8
    any other type (Q6_K, Q2_K, Q3_K, ...) -> dequantized, then re-quantized to q8 per 32-block
                           (finer than those types, so the error stays small)

Q5_* kept at 5 bits (20 + 8 bytes a block) rather than re-quantized to q8 (32 + 4, before
2026-12-01 22:00): SmolLM2's Q4_K_M (mostly Q5_0) reads 126.5 MB a decode step instead of 146.0,
one request on one thread decodes 1.07-1.13x faster with the AVX512 build (0.88-0.92x with the
AVX2 build: more instructions per block), 32 requests the same, and greedy tokens stay closer to
the float32 model's (benchmarks/README.md, cpuq5). Q6_K's 16-value sub-blocks with
int8 scales do not fit one scale per 32 values (folded into the weights, the int32 block sums
could overflow), so it stays re-quantized; scales stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32
KIND_CODE = {"q4": 4, "q5": 5, "q8": 8}  # the C kernels' kind argument
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight in one of the packed formats; ``source`` is the GGUF type it came from."""

    kind: str  # "q4" | "q5" | "q8"
    qs: torch.Tensor
    d: torch.Tensor  # [N, K/32] float32
    m: torch.Tensor | None  # [N, K/32] float32 (q4, q5; None for q8)
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
        q = torch.cat([qs[..., :16] & 0x0F, qs[..., :16] >> 4], dim=-1)  # [n, K/32, 32]
        if self.kind == "q5":
            q = q | (_high_bits(qs[..., 16:20]) << 4)
        q = q.float()
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
    if type_name == "Q5_0":  # d, qh, qs
        b = data.reshape(n, k // QK, 22)
        d = _f16(b[..., 0:2])
        return QuantWeight("q5", torch.cat([b[..., 6:22], b[..., 2:6]], dim=-1), d, -16.0 * d, type_name)
    if type_name == "Q5_1":  # d, m, qh, qs
        b = data.reshape(n, k // QK, 24)
        return QuantWeight(
            "q5", torch.cat([b[..., 8:24], b[..., 4:8]], dim=-1), _f16(b[..., 0:2]), _f16(b[..., 2:4]), type_name
        )
    if type_name == "Q5_K":
        return _q5_k(data.reshape(n, k // 256, 176))
    import gguf

    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return quantize_q8(torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(n, k)), type_name)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def _high_bits(qh: torch.Tensor) -> torch.Tensor:  # [..., 4] uint8 -> [..., 32] uint8: bit j of the uint32
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).flatten(-2)


def _pack_q5(values: torch.Tensor) -> torch.Tensor:  # [..., 32] uint8 in 0..31 -> [..., 20] q5 bytes
    low = values & 0x0F
    high = ((values >> 4) & 1).reshape(*values.shape[:-1], 4, 8) << torch.arange(8, dtype=torch.uint8)
    return torch.cat([low[..., :16] | (low[..., 16:] << 4), high.sum(-1, dtype=torch.uint8)], dim=-1)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 sub-blocks' d*sc and -dmin*mn of K-quant super-blocks [N, nsb, ...] (d, dmin, then
    12 bytes of 6-bit scales and mins, as Q4_K and Q5_K store them): two [N, nsb * 8]."""
    n = b.shape[0]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [N, nsb]
    sc_bytes = b[..., 4:16].to(torch.int32)  # [N, nsb, 12]
    lo, hi = sc_bytes[..., 0:4], sc_bytes[..., 4:8]
    top = sc_bytes[..., 8:12]
    scales = torch.cat([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], dim=-1).float()  # [N, nsb, 8]
    mins = torch.cat([hi & 63, (top >> 4) | ((hi >> 6) << 4)], dim=-1).float()
    return (d[..., None] * scales).reshape(n, -1), (-dmin[..., None] * mins).reshape(n, -1)


def _q4_k(b: torch.Tensor) -> QuantWeight:
    """Q4_K super-blocks of 256 (d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles)
    -> 8 q4 blocks each: sub-block s has w = d*sc[s]*q - dmin*mn[s]."""
    n, nsb, _ = b.shape
    qs = b[..., 16:].reshape(n, nsb, 4, 32)  # chunk c: low nibbles = sub-block 2c, high = 2c+1
    values = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, nsb * 8, 32)  # [N, K/32, 32]
    packed = values[..., :16] | (values[..., 16:] << 4)
    d, m = _k_scales(b)
    return QuantWeight("q4", packed.contiguous(), d, m, "Q4_K")


def _q5_k(b: torch.Tensor) -> QuantWeight:
    """Q5_K super-blocks of 256 (Q4_K's d, dmin and scales, then 32 bytes of high bits, 128 of
    nibbles) -> 8 q5 blocks each: value l of sub-block s has its bit 4 in bit s of qh byte l."""
    n, nsb, _ = b.shape
    qh = b[..., 16:48]  # [N, nsb, 32]
    qs = b[..., 48:].reshape(n, nsb, 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, nsb, 8, 32)
    high = (qh[:, :, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # [N, nsb, 8, 32]
    values = (low | (high << 4)).reshape(n, nsb * 8, 32)
    d, m = _k_scales(b)
    return QuantWeight("q5", _pack_q5(values).contiguous(), d, m, "Q5_K")

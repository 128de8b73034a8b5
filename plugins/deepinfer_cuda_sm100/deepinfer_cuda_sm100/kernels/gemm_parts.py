"""What the FP8 GEMM (``fp8_gemm``), the GEMVs (``fp8_gemv``, ``bf16_gemv``, ``moe_gemv``) and the
fused MoE share: e4m3 activation quantization of one 128-channel group per row, and split-K
sums (per-tile arrival counters, the separate sum launch). Kept apart so that ``fp8_gemm`` can
hand decode rows to ``fp8_gemv`` while ``fp8_gemv`` uses these without importing ``fp8_gemm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_elementwise import _round

FP8_BLOCK = 128


@triton.jit
def _quant_rows(a, UPCAST: tl.constexpr):
    """One activation group per row (a [rows, 128] float32) -> (e4m3 values, float32 scales):
    scale = amax / 448, values a / scale rounded to nearest; widened to float32 again in the
    interpreter, which multiplies in float32 (the same products)."""
    scale = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12) / 448.0
    v = a / scale[:, None]
    if UPCAST:  # the interpreter's float8 cast mis-rounds where rounding carries into the exponent
        q = _round_e4m3(v)
    else:
        q = v.to(tl.float8e4nv)
    return q, scale


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), kept float32:
    3 mantissa bits for normal values, multiples of 2^-9 below 2^-6 (subnormals)."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + (((bits >> 20) & 1) + 0x7FFFF)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0) / 512.0
    sub = tl.where(v < 0, -sub, sub)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


class SplitCounters:
    """Per-tile arrival counters for split-K GEMMs that sum their own splits (``FIXUP``), one
    zeroed buffer per (device, stream), allocated at the first call on that stream (the eager
    warm-up before a CUDA-graph capture) and left at zero by every launch. Launches on one
    stream run one after another, so they can share it; GEMMs on two streams get two."""

    CAPACITY = 8192  # output tiles; a GEMM with more falls back to the separate sum launch

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, device: torch.device, tiles: int) -> torch.Tensor | None:
        if tiles > self.CAPACITY:
            return None
        key = (device.index or 0, torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else (-1, 0)
        buf = self._buffers.get(key)
        if buf is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None  # never allocate inside a capture: this launch sums separately
            buf = self._buffers[key] = torch.zeros(self.CAPACITY, dtype=torch.int32, device=device)
        return buf


@triton.jit
def _split_sum_kernel(ws_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for j in tl.static_range(1, SPLIT):  # split order, whatever the grid ran first
        acc += tl.load(ws_ptr + j * MN + offs, mask=mask, other=0.0)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, _round(acc, out_ty).to(out_ty), mask=mask)

"""MXFP4 weight tiles decoded inside a kernel (DeepSeek-V4's routed experts, kept packed by the
engine where this plugin offers ``FusedOps.mxfp4_moe``; layout in ``deepinfer_core.models.mxfp4``).

A weight row of K inputs is K/2 bytes (the even input in the low nibble) and K/32 UE8M0
exponents. :func:`_mxfp4_tile` loads ``[BLOCK_N, BLOCK_K]`` of it as float32: one load of the
``BLOCK_K / 2`` bytes of each row. A nibble's magnitude bits ``(e, m)`` shifted to bits 22-24 of
a float32 (two exponent bits, one mantissa bit) with its sign at bit 31 are the float32
``e2m1 * 2^-126`` for every code (e = 0 gives the subnormal ``m * 2^-127``, the
0.5 of e2m1 scaled alike), so one multiply by ``2^(b - 1)`` (the group's ``2^(b - 127)`` times
``2^126``) gives the value: five integer operations and a multiply a weight, no table, no compare
(the decode with compares and selects before it bounded the MoE call at decode batch sizes; this
one takes 0.64x / 0.84x / 0.88x its time at 1 / 16 / 64 tokens of V4-mini on an H100:
``benchmarks/kernels/mxfp4_moe_tiles.py``).
A tile whose exponents pass 128 (``2^(b - 1)`` past float32's range: weights of magnitude 12 and
more, which trained checkpoints do not hold) multiplies twice, by ``2^126`` and by ``2^(b - 127)``.
The nibbles are interleaved back into input order (``join`` + ``reshape``). Every value is exact
in float32, bf16 and fp16 (e2m1 has one mantissa bit), so casting the tile to the activation dtype
before a ``tl.dot`` loses nothing: the product is the reference's product on weights dequantized
at load.

Plain Triton (integer ops, bitcasts, ``join``): the same code on SM90 and SM100. SM100's native
block-scaled MMAs (``tl.dot_scaled``) are not used yet; they would go behind the platform's
capability check.
"""

from __future__ import annotations

import triton
import triton.language as tl

MXFP4_GROUP = 32  # inputs per UE8M0 scale


@triton.jit
def _ue8m0(b):
    """UE8M0 exponent bytes (int32 0..254) -> float32 2^(b - 127) (b = 0: 2^-127, subnormal)."""
    bits = tl.where(b > 0, b << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_tile(
    w_base, s_base, rows, row_ok, k0, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Rows ``rows [BLOCK_N]`` (int64 row indices, ``row_ok`` masks them), inputs ``k0 ..
    k0 + BLOCK_K`` (``BLOCK_K`` a multiple of 32, ``k0`` of ``BLOCK_K``) of a packed weight
    (``w_base``: uint8 rows of ``stride_wn`` bytes; ``s_base``: uint8 exponent rows of
    ``stride_sn``) -> float32 ``[BLOCK_N, BLOCK_K]``, 0 outside ``row_ok`` and ``K``."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ok = row_ok[:, None] & (kb < K // 2)[None, :]
    packed = tl.load(w_base + rows[:, None] * stride_wn + kb[None, :], mask=ok, other=0).to(tl.int32)
    G: tl.constexpr = BLOCK_K // 32
    kg = k0 // 32 + tl.arange(0, G)
    s_ok = row_ok[:, None] & (kg < K // 32)[None, :]
    b = tl.load(s_base + rows[:, None] * stride_sn + kg[None, :], mask=s_ok, other=127).to(tl.int32)
    # e2m1 * 2^-126 (see the module docstring): magnitude bits to 22-24, the sign to 31
    lo = (((packed & 7) << 22) | ((packed & 8) << 28)).to(tl.float32, bitcast=True)  # input 2j
    hi = (((packed & 0x70) << 18) | ((packed & 0x80) << 24)).to(tl.float32, bitcast=True)  # input 2j + 1
    lo = tl.reshape(lo, [BLOCK_N, G, 16])
    hi = tl.reshape(hi, [BLOCK_N, G, 16])
    if tl.max(b) <= 128:  # 2^(b - 1) is a normal float32: one exact multiply
        scale = ((b + 126) << 23).to(tl.float32, bitcast=True)[:, :, None]
        lo, hi = lo * scale, hi * scale
    else:
        scale = _ue8m0(b)[:, :, None]
        lo, hi = (lo * 8.507059173023462e37) * scale, (hi * 8.507059173023462e37) * scale  # 2^126, then 2^(b - 127)
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])


@triton.jit
def _mxfp4_tile_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decoded weight ``[N, K]`` float32, tile by tile (tests check :func:`_mxfp4_tile`
    against the core's dequantization here)."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    row_ok = rows < N
    tile = _mxfp4_tile(w_ptr, s_ptr, rows, row_ok, k0, K, K // 2, K // 32, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], tile, mask=row_ok[:, None] & (cols < K)[None, :])


def dequant_mxfp4(packed, scale, block_n: int = 16, block_k: int = 64):
    """``packed`` uint8 ``[N, K/2]`` x ``scale`` uint8 ``[N, K/32]`` -> float32 ``[N, K]`` through
    :func:`_mxfp4_tile` (a test and debugging aid; the MoE kernels decode tiles in place)."""
    import torch

    N, K = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(N, K, dtype=torch.float32, device=packed.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    _mxfp4_tile_kernel[grid](packed.contiguous(), scale.contiguous(), out, N, K, BLOCK_N=block_n, BLOCK_K=block_k)
    return out

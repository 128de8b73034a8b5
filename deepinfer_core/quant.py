"""Dequantizing DeepSeek-V4's released weight formats to float32, for platforms without native
FP8 / FP4 kernels (the CPU reference path). Below the models: FP8 expert weights in the MoE
contract (``moe.ExpertWeights.dequantized``) decode through it too.

Two formats ship in the released checkpoints:

* **FP8 block**: ``float8_e4m3fn`` weight ``[out, in]`` with one scale per 128 x 128 tile,
  scale ``[ceil(out / 128), ceil(in / 128)]``; ``w = q * scale[r // 128, c // 128]``. The edge
  tiles of a dimension that is not a multiple of 128 are partial (DeepSeek's reference kernels
  use ceil division), so the scale grid is expanded and cropped, never inferred from the shape.
* **MXFP4** (routed experts): two e2m1 values per byte, the element at an even index in the low
  nibble, ``[out, in / 2]`` stored as int8 (or uint8); one UE8M0 scale per 32 consecutive
  input elements, ``[out, in / 32]``.

Scales come as ``float8_e8m0fnu`` (UE8M0, a power of two), raw UE8M0 bytes (``uint8``:
``2 ** (b - 127)``) or float32 (DeepSeek-V3 style ``weight_scale_inv``); all mean "multiply".
"""

from __future__ import annotations

__all__ = [
    "FP4_GROUP",
    "FP8_BLOCK",
    "dequant_fp4",
    "dequant_fp8_block",
    "fp4_scale_shape",
    "fp8_block_shape",
    "quant_fp4",
    "quant_fp8_block",
    "scale_to_float",
    "unpack_fp4",
]

import torch

FP8_BLOCK = 128
FP4_GROUP = 32
# e2m1 code -> value: sign bit 3, exponent bits 2..1, mantissa bit 0.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Any stored scale representation as float32 multipliers."""
    if scale.dtype == torch.uint8:  # UE8M0: 2^(e - 127), built from its bits (exact on every device)
        # e >= 1 is the float32 whose exponent field is e (255: inf); e = 0 is 2^-127, a subnormal,
        # which CUDA's exp2 rounds (5.877470e-39 for 5.877472e-39: seen on an H100, 2026-12-07)
        e = scale.to(torch.int32)
        return torch.where(e > 0, e << 23, 1 << 22).view(torch.float32)
    return scale.to(torch.float32)


def fp8_block_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Scale-grid shape of an FP8 weight of ``shape`` (the last two dims are tiled)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn [.., out, in]`` x tile scales -> float32 ``[.., out, in]``."""
    rows, cols = weight.shape[-2:]
    s = scale_to_float(scale)
    s = s.repeat_interleave(FP8_BLOCK, dim=-2)[..., :rows, :]
    s = s.repeat_interleave(FP8_BLOCK, dim=-1)[..., :cols]
    return weight.to(torch.float32) * s


def fp4_scale_shape(packed_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Scale shape of an MXFP4 weight stored as ``packed_shape`` (``[.., out, in / 2]``)."""
    *lead, cols_half = packed_shape
    return (*lead, 2 * cols_half // FP4_GROUP)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 codes per byte (low nibble first) -> float32, last dim doubled."""
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).long()
    return lut[codes].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``[.., out, in / 2]`` x ``[.., out, in / 32]`` scales -> float32 ``[.., out, in]``."""
    values = unpack_fp4(packed)
    return values * scale_to_float(scale).repeat_interleave(FP4_GROUP, dim=-1)


def quant_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float -> (``float8_e4m3fn``, UE8M0 tile scales), as the released checkpoints store it:
    each tile's scale is the power of two at or above ``amax / 448``. For test checkpoints."""
    rows, cols = weight.shape[-2:]
    w = weight.to(torch.float32)
    pad = (0, -cols % FP8_BLOCK, 0, -rows % FP8_BLOCK)
    tiles = torch.nn.functional.pad(w, pad).unflatten(-2, (-1, FP8_BLOCK)).unflatten(-1, (-1, FP8_BLOCK))
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-30)  # [.., R, C]
    scale = torch.exp2(torch.ceil(torch.log2(amax / torch.finfo(torch.float8_e4m3fn).max)))
    q = w / scale.repeat_interleave(FP8_BLOCK, -2)[..., :rows, :].repeat_interleave(FP8_BLOCK, -1)[..., :cols]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quant_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[.., out, in]`` -> (int8 ``[.., out, in / 2]``, UE8M0 ``[.., out, in / 32]``):
    per group of 32, scale = the power of two at or above ``amax / 6``, values rounded to the
    nearest e2m1 code. For test checkpoints."""
    w = weight.to(torch.float32)
    groups = w.unflatten(-1, (-1, FP4_GROUP))
    amax = groups.abs().amax(dim=-1).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    x = groups / scale[..., None]
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    codes = (x[..., None] - lut).abs().argmin(dim=-1).flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)

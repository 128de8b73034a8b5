"""One-kernel RMSNorm and SiLU-and-mul (``deepinfer_fused_ops``).

A torch RMSNorm is ~8 launches and as many passes over the row; in a 1-request decode step
those small launches, not bytes, are the cost (the V3-mini graph holds 33 norms). Here one
program owns one row: it reads it once, reduces in float32 in a fixed order (so a row's result
never depends on the batch), and writes once, rounding exactly where the references in
:mod:`deepinfer_core.fused_ops` round (normalised value to the input dtype, then the product
with the weight to the output dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.fused_ops import FusedOps

from .pdl import gdc_enter, launch_kw


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (float32) rounded to ``dtype``, nearest-even, kept as float32. bfloat16 is rounded
    with integer ops: Triton's CPU interpreter truncates float32 -> bfloat16 casts."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, D, eps, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    y = _round(x * (1.0 / tl.sqrt(var + eps)), x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _round(w * y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_h,
    D,
    eps,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The residual add (rounded to the residual's dtype, as torch adds) stored, then the norm of
    that sum as :func:`_rms_norm_kernel` computes it: one read of each input row, two writes."""
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h_ty = h_ptr.dtype.element_ty
    h = _round(x + r, h_ty)
    tl.store(h_ptr + row * stride_h + offs, h.to(h_ty), mask=mask)
    var = tl.sum(h * h, axis=0) / D
    y = _round(h * (1.0 / tl.sqrt(var + eps)), h_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _round(w * y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), x_ptr.dtype.element_ty)  # F.silu rounds to the dtype
    out = _round(act * up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cat_kernel(
    lat_ptr,
    pe_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    s_lt,
    s_lh,
    s_pt,
    s_ph,
    s_ot,
    s_oh,
    s_cos,
    H,
    C,
    HALF,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One token's ``BLOCK_H`` heads: the token's cos/sin row is read once for all of them and
    each load is a [heads, channels] tile (a program per (token, head) ran 16 x more programs of
    one 384-byte row each: 4.6 ms of a V3-mini 64 x 512 prefill on the H200)."""
    gdc_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    h = h.to(tl.int64)
    out_rows = out_ptr + t * s_ot + h[:, None] * s_oh
    lat_rows = lat_ptr + t * s_lt + h[:, None] * s_lh
    for c0 in range(0, C, BLOCK_C):  # the latent part, copied
        offs = c0 + tl.arange(0, BLOCK_C)
        m = h_ok[:, None] & (offs < C)[None, :]
        tl.store(out_rows + offs[None, :], tl.load(lat_rows + offs[None, :], mask=m), mask=m)
    j = tl.arange(0, BLOCK_R)
    jm = j < HALF
    m = h_ok[:, None] & jm[None, :]
    pe_rows = pe_ptr + t * s_pt + h[:, None] * s_ph
    if INTERLEAVED:  # channel pairs (2j, 2j+1) become (j, j + half)
        a = tl.load(pe_rows + 2 * j[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(pe_rows + 2 * j[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    else:
        a = tl.load(pe_rows + j[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(pe_rows + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    dt = pe_ptr.dtype.element_ty
    p = tl.load(pos_ptr + t).to(tl.int64)
    c1 = _round(tl.load(cos_ptr + p * s_cos + j, mask=jm, other=0.0).to(tl.float32), dt)[None, :]
    c2 = _round(tl.load(cos_ptr + p * s_cos + HALF + j, mask=jm, other=0.0).to(tl.float32), dt)[None, :]
    s1 = _round(tl.load(sin_ptr + p * s_cos + j, mask=jm, other=0.0).to(tl.float32), dt)[None, :]
    s2 = _round(tl.load(sin_ptr + p * s_cos + HALF + j, mask=jm, other=0.0).to(tl.float32), dt)[None, :]
    first = _round(_round(a * c1, dt) + _round(-b * s1, dt), dt)  # x * cos + rotate_half(x) * sin
    second = _round(_round(b * c2, dt) + _round(a * s2, dt), dt)
    od = out_ptr.dtype.element_ty
    tl.store(out_rows + C + j[None, :], first.to(od), mask=m)
    tl.store(out_rows + C + HALF + j[None, :], second.to(od), mask=m)


@triton.jit
def _norm_rope_cat_kernel(
    lat_ptr,
    w_ptr,
    pe_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    s_lt,
    s_pt,
    s_ot,
    s_cos,
    C,
    HALF,
    eps,
    INTERLEAVED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One token's MLA cache entry: :func:`_rms_norm_kernel`'s row (the same loads, float32
    reduction and rounding points) stored as the latent part, then :func:`_rope_cat_kernel`'s
    rotary of the one rope head: both kernels' arithmetic in one launch."""
    gdc_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < C
    x = tl.load(lat_ptr + t * s_lt + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / C
    y = _round(x * (1.0 / tl.sqrt(var + eps)), lat_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    od = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * s_ot + offs, _round(w * y, od).to(od), mask=mask)
    j = tl.arange(0, BLOCK_R)
    jm = j < HALF
    pe_row = pe_ptr + t * s_pt
    if INTERLEAVED:  # channel pairs (2j, 2j+1) become (j, j + half)
        a = tl.load(pe_row + 2 * j, mask=jm, other=0.0).to(tl.float32)
        b = tl.load(pe_row + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)
    else:
        a = tl.load(pe_row + j, mask=jm, other=0.0).to(tl.float32)
        b = tl.load(pe_row + HALF + j, mask=jm, other=0.0).to(tl.float32)
    dt = pe_ptr.dtype.element_ty
    p = tl.load(pos_ptr + t).to(tl.int64)
    c1 = _round(tl.load(cos_ptr + p * s_cos + j, mask=jm, other=0.0).to(tl.float32), dt)
    c2 = _round(tl.load(cos_ptr + p * s_cos + HALF + j, mask=jm, other=0.0).to(tl.float32), dt)
    s1 = _round(tl.load(sin_ptr + p * s_cos + j, mask=jm, other=0.0).to(tl.float32), dt)
    s2 = _round(tl.load(sin_ptr + p * s_cos + HALF + j, mask=jm, other=0.0).to(tl.float32), dt)
    first = _round(_round(a * c1, dt) + _round(-b * s1, dt), dt)  # x * cos + rotate_half(x) * sin
    second = _round(_round(b * c2, dt) + _round(a * s2, dt), dt)
    tl.store(out_ptr + t * s_ot + C + j, first.to(od), mask=jm)
    tl.store(out_ptr + t * s_ot + C + HALF + j, second.to(od), mask=jm)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, s_xt, s_xh, s_ct, s_st, s_ot, s_oh, HALF, BLOCK_R: tl.constexpr):
    """One (token, head) row: rotate-half rotary with the token's cos/sin row (already in x's
    dtype), each product and the sum rounded to that dtype as the torch ops round."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    m = j < HALF
    row = x_ptr + t * s_xt + h * s_xh
    a = tl.load(row + j, mask=m, other=0.0).to(tl.float32)
    b = tl.load(row + HALF + j, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * s_ct + j, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * s_ct + HALF + j, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * s_st + j, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * s_st + HALF + j, mask=m, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    first = _round(_round(a * c1, dt) + _round(-b * s1, dt), dt)
    second = _round(_round(b * c2, dt) + _round(a * s2, dt), dt)
    out_row = out_ptr + t * s_ot + h * s_oh
    od = out_ptr.dtype.element_ty
    tl.store(out_row + j, first.to(od), mask=m)
    tl.store(out_row + HALF + j, second.to(od), mask=m)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, d]`` (rows may be strided, e.g. a slice of a fused QKV output) rotated with
    ``cos``/``sin [T, 1, d]`` in x's dtype: one launch instead of ~5 torch ops per layer."""
    T, H, d = x.shape
    if (
        x.stride(-1) != 1
        or cos.stride(-1) != 1
        or sin.stride(-1) != 1
        or d % 2
        or cos.dtype != x.dtype
        or sin.dtype != x.dtype
    ):
        from deepinfer_core.fused_ops import rotary_reference

        return rotary_reference(x, cos, sin)
    out = torch.empty(T, H, d, dtype=x.dtype, device=x.device)
    if T and H:
        _rotary_kernel[(T, H)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
            d // 2, BLOCK_R=triton.next_power_of_2(max(1, d // 2)), num_warps=1, enable_fp_fusion=False,
        )  # fmt: skip
    return out


ROPE_CAT_TILE_TOKENS = 256  # from this many tokens rope_cat puts up to 16 heads in a program


def rope_cat(
    latent: torch.Tensor,
    pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    T, H, C = latent.shape[0], pe.shape[1], latent.shape[-1]
    r = pe.shape[-1]
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    if pe.stride(-1) != 1:
        pe = pe.contiguous()
    out = torch.empty(T, H, C + r, dtype=latent.dtype, device=latent.device)
    if T:
        lat_h = latent.stride(1) if latent.shape[1] == H else 0  # a key's one latent row serves every head
        # many tokens: a program per token's heads; a decode step: a program per (token, head)
        # (one program per token left a 1-request step 7 us slower over its 16 launches)
        block_h = min(triton.next_power_of_2(H), 16) if T >= ROPE_CAT_TILE_TOKENS else 1
        block_c = max(16, min(triton.next_power_of_2(C), 4096 // block_h))
        _rope_cat_kernel[(T, triton.cdiv(H, block_h))](
            latent, pe, positions, cos, sin, out,
            latent.stride(0), lat_h, pe.stride(0), pe.stride(1), out.stride(0), out.stride(1), cos.stride(0), H, C,
            r // 2, INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_C=block_c,
            BLOCK_R=triton.next_power_of_2(max(1, r // 2)), **launch_kw(latent), num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def norm_rope_cat(
    latent: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pe: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """``rope_cat(rms_norm(latent, weight, eps)[:, None], pe, ...)`` (MLA's key: ``latent [T, C]``,
    ``pe [T, 1, r]``) in one launch instead of two, the same values (FusedOps.norm_rope_cat)."""
    T, C, r = latent.shape[0], latent.shape[-1], pe.shape[-1]
    if weight.dtype != latent.dtype or pe.dtype != latent.dtype or pe.shape[1] != 1:
        return rope_cat(rms_norm(latent, weight, eps)[:, None, :], pe, positions, cos, sin, interleaved)
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    if pe.stride(-1) != 1:
        pe = pe.contiguous()
    out = torch.empty(T, 1, C + r, dtype=latent.dtype, device=latent.device)
    if T:
        block = triton.next_power_of_2(C)
        warps = 1 if block <= 256 else 4 if block <= 2048 else 8  # rms_norm's: the same reduction
        _norm_rope_cat_kernel[(T,)](
            latent, weight, pe, positions, cos, sin, out, latent.stride(0), pe.stride(0), out.stride(0), cos.stride(0),
            C, r // 2, eps, INTERLEAVED=interleaved, BLOCK=block, BLOCK_R=triton.next_power_of_2(max(1, r // 2)),
            **launch_kw(latent), num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit stride along D (a view where possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    D = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        warps = 1 if block <= 256 else 4 if block <= 2048 else 8
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight,
            out,
            x2.stride(0),
            out.stride(0),
            D,
            eps,
            BLOCK=block,
            **launch_kw(x2),
            num_warps=warps,
            enable_fp_fusion=False,
        )
    return out.view(*x.shape[:-1], D)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)`` in one launch (inputs of one dtype and shape;
    anything else takes the two separate ops)."""
    if x.dtype != residual.dtype or x.shape != residual.shape:
        h = residual + x
        return rms_norm(h, weight, eps), h
    D = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    h = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        warps = 1 if block <= 256 else 4 if block <= 2048 else 8
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, h, x2.stride(0), r2.stride(0), out.stride(0), h.stride(0), D, eps,
            BLOCK=block, **launch_kw(x2), num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(*x.shape[:-1], D), h.view(*x.shape[:-1], D)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    I = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], I), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(I))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(I, block))](
            x2, out, x2.stride(0), out.stride(0), I, BLOCK=block, **launch_kw(x2), num_warps=4, enable_fp_fusion=False
        )
    return out.view(*x.shape[:-1], I)


FUSED_OPS = FusedOps(
    rms_norm=rms_norm,
    silu_and_mul=silu_and_mul,
    rope_cat=rope_cat,
    norm_rope_cat=norm_rope_cat,
    add_rms_norm=add_rms_norm,
    rotary=rotary,
)

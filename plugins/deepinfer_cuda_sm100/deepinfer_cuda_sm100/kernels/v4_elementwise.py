"""DeepSeek-V4's RMSNorms and rope in one launch each (``FusedOps.v4_rms_norm`` /
``v4_unweighted_rms_norm`` / ``v4_rope``).

A V4 decode step runs ~33 weighted norms (~6 torch kernels each) and, in each layer's
attention, three ropes (queries, key, un-roped output; ~9 kernels each) - together ~400 of the
~1,400 launches left in a 1-request V4-mini step (benchmarks/README.md, ``v4_step_kernels.py``).
V4 rounds differently from Llama, so :mod:`.fused_elementwise`'s norm does not serve: the weight
multiplies the float32 normalised row before the one rounding
(:class:`deepinfer_core.models.deepseek_v4.layers.V4RMSNorm`), and the rope rotates interleaved
pairs of the trailing channels in float32 then rounds once (``V4Rope.apply``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _pow2


@triton.jit
def _v4_rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * (x * rms)).to(out_ptr.dtype.element_ty), mask=mask)


def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(weight * normalised(x.float())).to(x.dtype)``, x [..., D]."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"v4_rms_norm: weight must be [{D}] (x's last dimension), got {tuple(weight.shape)}")
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _v4_rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), D, float(eps), BLOCK=max(16, _pow2(D)), num_warps=4
        )
    return out.view(x.shape)


@triton.jit
def _v4_unweighted_rms_norm_kernel(x_ptr, out_ptr, stride_x, stride_o, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    rms = (
        (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)).to(ty).to(tl.float32)
    )  # rounded to x's dtype first, as the reference
    tl.store(out_ptr + row * stride_o + offs, (x * rms).to(ty), mask=mask)


def v4_unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x.float()^2) + eps).to(x.dtype)`` (``unweighted_rms_norm``: V4's query
    norm and the hyper-connections' input norm), x [..., D]; ~4 torch kernels in one launch."""
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = max(16, _pow2(D))
        _v4_unweighted_rms_norm_kernel[(rows.shape[0],)](
            rows, out, rows.stride(0), out.stride(0), D, float(eps), BLOCK=block, num_warps=8 if block >= 4096 else 4
        )
    return out.view(x.shape)


@triton.jit
def _v4_rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_c, H,
                    NOPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HALF: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    t = pid // H
    h = pid % H
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + t * stride_ot + h * stride_oh
    for c0 in range(0, NOPE, BLOCK_NOPE):  # the channels without rope: copied
        c = c0 + tl.arange(0, BLOCK_NOPE)
        tl.store(dst + c, tl.load(src + c, mask=c < NOPE), mask=c < NOPE)
    k = tl.arange(0, BLOCK_HALF)  # rope pairs; r/2 need not be a power of two (a config may say 24 or 48)
    ok = k < HALF
    even = tl.load(src + NOPE + 2 * k, mask=ok, other=0.0).to(tl.float32)
    odd = tl.load(src + NOPE + 2 * k + 1, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_c + k, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_c + k, mask=ok, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(dst + NOPE + 2 * k, (even * cos - odd * sin).to(ty), mask=ok)
    tl.store(dst + NOPE + 2 * k + 1, (odd * cos + even * sin).to(ty), mask=ok)


def v4_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``V4Rope.apply``: x [T, H, D] or [T, D]; cos / sin [T, r / 2] in x's dtype; the last r
    channels rotated in pairs (0, 1), (2, 3), ...; a new tensor."""
    T, D, half = x.shape[0], x.shape[-1], cos.shape[-1]
    if cos.shape != (T, half) or sin.shape != (T, half) or 2 * half > D:
        raise ValueError(
            f"v4_rope: cos and sin must be [T={T}, r/2] with r <= {D}; got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    H = x3.shape[1]
    nope = D - 2 * half
    if T * H:
        _v4_rope_kernel[(T * H,)](
            x3, cos, sin, out, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), cos.stride(0), H,
            NOPE=nope, BLOCK_NOPE=min(512, max(16, _pow2(nope))), HALF=half, BLOCK_HALF=max(2, _pow2(half)),
            num_warps=4,
        )  # fmt: skip
    return out.view(x.shape)

"""DeepSeek-V4's hyper-connection weights in one launch (``FusedOps.hc_mix``).

Each of a V4 layer's two hyper-connections turns its mixing projection into ``pre``, ``post``
and a Sinkhorn-normalised ``comb`` (``hc x hc``, 20 iterations in the released config), then
collapses the ``hc`` streams by ``pre``. In torch that is ~4 kernels per iteration on a few
dozen numbers: ~90 launches per call, 16 calls per step of an 8-layer model, more than the rest
of a 1-request decode step together (counted in benchmarks/README.md). Here one program per
token keeps the ``hc x hc`` matrix in registers through every iteration and then streams the
token's ``hc`` rows once. Same operations and order as
:func:`deepinfer_core.models.deepseek_v4.layers.hc_mix_reference`, in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_elementwise import _round
from .invariant import INVARIANT
from .paged_attention import _pow2


@triton.jit
def _partial_sum_1d(row, idx, mask, stride_p, S, BLOCK_S: tl.constexpr):
    """Sum over the ``S`` split-K partial rows at ``row`` (stride ``stride_p``) of the values at
    ``idx`` [B]: one load of [BLOCK_S, B], then a fixed-shape reduction (the same order for
    every token: batch-invariant)."""
    s = tl.arange(0, BLOCK_S)
    v = tl.load(row + s[:, None] * stride_p + idx[None, :], mask=(s < S)[:, None] & mask[None, :], other=0.0)
    return tl.sum(v, axis=0)


@triton.jit
def _partial_sum_2d(row, idx, mask, stride_p, S, BLOCK_S: tl.constexpr):
    """:func:`_partial_sum_1d` for ``idx`` [B, B]."""
    s = tl.arange(0, BLOCK_S)
    v = tl.load(
        row + s[:, None, None] * stride_p + idx[None, :, :], mask=(s < S)[:, None, None] & mask[None, :, :], other=0.0
    )
    return tl.sum(v, axis=0)


@triton.jit
def _hc_mix_kernel(
    mixed_ptr, base_ptr, scale_ptr, streams_ptr, post_ptr, comb_ptr, out_ptr,
    stride_m, stride_st, stride_sh, stride_o, D, iters, eps, S, K, norm_eps,
    HC: tl.constexpr, BLOCK_HC: tl.constexpr, BLOCK_D: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HC)
    ok = i < HC
    pre_s = tl.load(scale_ptr)
    post_s = tl.load(scale_ptr + 1)
    comb_s = tl.load(scale_ptr + 2)
    cell = i[:, None] * HC + i[None, :]
    both = ok[:, None] & ok[None, :]
    if PARTIAL:  # rows of S partials [(2 + hc) * hc dots, sum of squares]: summed, times the input norm's rsqrt
        row = mixed_ptr + t * S * stride_m
        si = tl.arange(0, BLOCK_S)
        ss = tl.sum(tl.load(row + si * stride_m + (2 + HC) * HC, mask=si < S, other=0.0), axis=0)
        r = 1.0 / tl.sqrt(ss / K + norm_eps)
        pre_w = _partial_sum_1d(row, i, ok, stride_m, S, BLOCK_S) * r
        post_w = _partial_sum_1d(row, HC + i, ok, stride_m, S, BLOCK_S) * r
        comb_w = _partial_sum_2d(row, 2 * HC + cell, both, stride_m, S, BLOCK_S) * r
    else:
        row = mixed_ptr + t * stride_m
        pre_w = tl.load(row + i, mask=ok, other=0.0)
        post_w = tl.load(row + HC + i, mask=ok, other=0.0)
        comb_w = tl.load(row + 2 * HC + cell, mask=both, other=0.0)
    pre = tl.sigmoid(pre_w * pre_s + tl.load(base_ptr + i, mask=ok, other=0.0)) + eps
    post = 2 * tl.sigmoid(post_w * post_s + tl.load(base_ptr + HC + i, mask=ok, other=0.0))
    tl.store(post_ptr + t * HC + i, post, mask=ok)
    logits = comb_w * comb_s + tl.load(base_ptr + 2 * HC + cell, mask=both, other=0.0)
    logits = tl.where(both, logits, float("-inf"))
    top = tl.where(ok, tl.max(logits, axis=1), 0.0)  # padding rows (hc not a power of two): no inf - inf
    e = tl.where(both, tl.exp(logits - top[:, None]), 0.0)
    total = tl.where(ok, tl.sum(e, axis=1), 1.0)
    comb = tl.where(both, e / total[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(comb_ptr + t * HC * HC + cell, comb, mask=both)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        x = tl.load(
            streams_ptr + t * stride_st + i[:, None] * stride_sh + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0
        )
        acc = tl.sum(pre[:, None] * x.to(tl.float32), axis=0)
        tl.store(out_ptr + t * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=dm)


def hc_mix(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor, iters: int, eps: float):
    """(post [T, hc] float32, comb [T, hc, hc] float32, collapsed [T, D] in the streams' dtype)."""
    T, hc, D = streams.shape
    if mixed.shape != (T, (2 + hc) * hc) or base.shape != ((2 + hc) * hc,) or scale.shape != (3,):
        raise ValueError(f"hc_mix: mixed must be [T={T}, {(2 + hc) * hc}], base [{(2 + hc) * hc}], scale [3]; got "
                         f"{tuple(mixed.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}")  # fmt: skip
    mixed, base, scale = mixed.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    post = torch.empty(T, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=streams.device)
    out = torch.empty(T, D, dtype=streams.dtype, device=streams.device)
    if T:
        _hc_mix_kernel[(T,)](
            mixed, base, scale, streams, post, comb, out, mixed.stride(0), streams.stride(0), streams.stride(1),
            out.stride(0), D, int(iters), float(eps), 1, 1, 0.0, HC=hc, BLOCK_HC=max(2, _pow2(hc)),
            BLOCK_D=min(1024, max(16, _pow2(D))), PARTIAL=False, BLOCK_S=1, num_warps=4,
        )  # fmt: skip
    return post, comb, out


# Up to this many tokens (decode batches) hc_pre runs; a longer call (prefill) declines, as the
# split-K products would read ``fn`` once per token where a GEMM reads it once.
HC_PRE_MAX_TOKENS = 256
HC_PRE_BLOCK_K = 256


@triton.jit
def _hc_project_kernel(
    x_ptr, fn_ptr, part_ptr, stride_x, stride_p, K, M, S,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One token's flattened streams against ``fn``'s rows over one ``BLOCK_K`` slice of K:
    the slice's M dot products and its sum of squares, as a partial row."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    k = s * BLOCK_K + tl.arange(0, BLOCK_K)
    km = k < K
    x = tl.load(x_ptr + t * stride_x + k, mask=km, other=0.0).to(tl.float32)
    m = tl.arange(0, BLOCK_M)
    mm = m < M
    w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
    out = part_ptr + (t * S + s) * stride_p
    tl.store(out + m, tl.sum(w * x[None, :], axis=1), mask=mm)
    tl.store(out + M, tl.sum(x * x, axis=0))


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float):  # fmt: skip
    """``HyperConnection.forward`` in two launches for a decode batch: the input norm and the
    mixing projection as split-K partial products (one program per token and 256 columns of
    ``hc * D``, each with its slice's sum of squares), then :func:`hc_mix`'s kernel summing the
    partials (one load of every partial row, a fixed-shape reduction) and scaling them by the
    norm's rsqrt (``r * (x . fn)`` for the reference's ``(r * x) . fn``: float32 rounding
    apart). Each token's result depends on that token alone. Returns None (the caller runs the
    torch ops) for more than ``HC_PRE_MAX_TOKENS`` tokens and inside a batch-invariant forward
    (whose GEMMs are the invariant kernels, so a request's numbers do not depend on which path
    its batch took)."""
    T, hc, D = streams.shape
    M, K = (2 + hc) * hc, hc * D
    if T > HC_PRE_MAX_TOKENS or INVARIANT.get():
        return None
    if fn.shape != (M, K) or base.shape != (M,) or scale.shape != (3,):
        raise ValueError(f"hc_pre: fn must be [{M}, {K}], base [{M}], scale [3] for streams [T, {hc}, {D}]; got "
                         f"{tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}")  # fmt: skip
    fn, base, scale = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
    if not streams.is_contiguous():
        streams = streams.contiguous()
    post = torch.empty(T, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=streams.device)
    out = torch.empty(T, D, dtype=streams.dtype, device=streams.device)
    if T:
        S = -(-K // HC_PRE_BLOCK_K)
        parts = torch.empty(T * S, M + 1, dtype=torch.float32, device=streams.device)
        _hc_project_kernel[(T, S)](
            streams, fn, parts, streams.stride(0), parts.stride(0), K, M, S, BLOCK_M=_pow2(M),
            BLOCK_K=HC_PRE_BLOCK_K, num_warps=4,
        )  # fmt: skip
        _hc_mix_kernel[(T,)](
            parts, base, scale, streams, post, comb, out, parts.stride(0), streams.stride(0), streams.stride(1),
            out.stride(0), D, int(iters), float(eps), S, K, float(norm_eps), HC=hc, BLOCK_HC=max(2, _pow2(hc)),
            BLOCK_D=min(1024, max(16, _pow2(D))), PARTIAL=True, BLOCK_S=max(2, _pow2(S)), num_warps=4,
        )  # fmt: skip
    return post, comb, out


@triton.jit
def _hc_merge_kernel(
    s_ptr, o_ptr, post_ptr, comb_ptr, out_ptr, stride_st, stride_sh, stride_o, stride_rt, stride_rh, D,
    HC: tl.constexpr, BLOCK_HC: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    j = tl.arange(0, BLOCK_HC)
    jm = j < HC
    ty = s_ptr.dtype.element_ty
    o = tl.load(o_ptr + t * stride_o + d, mask=dm, other=0.0).to(tl.float32)
    post = _round(tl.load(post_ptr + t * HC + j, mask=jm, other=0.0), ty)
    expand = _round(post[:, None] * o[None, :], ty)  # post.to(dtype) * out, rounded as torch multiplies
    mixed = tl.zeros((BLOCK_HC, BLOCK_D), tl.float32)
    for i in tl.static_range(HC):  # comb^T @ streams: a float32 sum of the hc rows, rounded once
        c = _round(tl.load(comb_ptr + t * HC * HC + i * HC + j, mask=jm, other=0.0), ty)
        row = tl.load(s_ptr + t * stride_st + i * stride_sh + d, mask=dm, other=0.0).to(tl.float32)
        mixed += c[:, None] * row[None, :]
    res = _round(expand + _round(mixed, ty), ty)
    tl.store(out_ptr + t * stride_rt + j[:, None] * stride_rh + d[None, :], res.to(ty), mask=jm[:, None] & dm[None, :])


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``deepseek_v4_layers.hc_merge``: ``post * out`` expanded over the streams plus
    ``comb^T @ streams``, in the streams' dtype, one launch."""
    T, hc, D = streams.shape
    if out.shape != (T, D) or post.shape != (T, hc) or comb.shape != (T, hc, hc):
        raise ValueError(f"hc_merge: out must be [T={T}, D={D}], post [T, {hc}], comb [T, {hc}, {hc}]; got "
                         f"{tuple(out.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}")  # fmt: skip
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    out = out.to(streams.dtype) if out.stride(-1) == 1 else out.to(streams.dtype).contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    res = torch.empty(T, hc, D, dtype=streams.dtype, device=streams.device)
    block_d = min(512, max(16, _pow2(D)))
    if T:
        _hc_merge_kernel[(T, -(-D // block_d))](
            streams, out, post, comb, res, streams.stride(0), streams.stride(1), out.stride(0), res.stride(0),
            res.stride(1), D, HC=hc, BLOCK_HC=max(2, _pow2(hc)), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return res

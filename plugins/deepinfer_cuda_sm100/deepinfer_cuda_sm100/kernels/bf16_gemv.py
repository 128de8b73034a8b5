"""16-bit GEMV for decode: ``y = x @ W^T`` for 1 to :data:`GEMV_ROWS` rows of bf16 / fp16.

Why: at one request every dense projection of a decode step is a pure weight read, and cuBLAS
runs them at one row far from the read rate (H200, V3-mini bf16, one request: the MLA
projections' 32 launches took 0.141 ms for 212 MB, the absorbed per-head products' 16 launches
0.107 ms for 34 MB, against 4.2 TB/s for a plain copy). Here each program streams a
``[BLOCK_N, BLOCK_K]`` slab of the weight per step, multiplies it on the CUDA cores in float32
(no MMA, no padding rows) and rounds once; K is split over enough programs to keep the memory
system busy, the splits summed in split order by the last program of each column tile (arrival
counters, as ``fp8_gemv``) or by a separate launch. A third grid axis runs a stack of weights at
once (MLA's per-head ``W_UK`` / ``W_UV`` products), any strides (``W_UK`` is read along N).

Only the order of the float32 sums differs from cuBLAS (which also accumulates in float32), so a
row's result can differ from it in the last bit: batch-invariant forwards and float32 never come
here (:func:`dense_linear` and :func:`head_linear` hand them to torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .fp8_gemv import _gemv_epilogue
from .fused_elementwise import _round
from .gemm_parts import SplitCounters, _split_sum_kernel
from .paged_attention import _pow2, interpreting
from .pdl import gdc_enter, launch_kw

GEMV_ROWS = 1  # rows up to which the GEMV replaces cuBLAS (H200: at 2 rows it lost or tied per shape)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Bf16GemvConfig:
    """Weight rows per program (``block_n``), K per step (``block_k``; the slab is
    ``block_n x block_k`` elements), warps, and how many programs K splits should aim for
    (``split``: 1 none, 0 from ``target_programs``)."""

    block_n: int = 16
    block_k: int = 512
    warps: int = 4
    target_programs: int = 528  # 4 per H200 SM
    split: int = 0


# per-head products (H200, V3-mini, 8 layers of 16 heads, one row: bf16_gemv.py --sweep, call 1)
HEADS_K = Bf16GemvConfig(block_n=8, block_k=512, warps=4, split=1)  # K contiguous (W_UV): 0.0278 ms vs cuBLAS 0.0353
HEADS_N = Bf16GemvConfig(block_n=64, block_k=128, warps=4, split=1)  # N contiguous (W_UK^T): 0.0294 vs 0.0333
PROGRAMS = 1056  # 8 per H200 SM


def dense_config(N: int, K: int) -> Bf16GemvConfig:
    """No K split (each split adds a partial store, an arrival and a reload to a launch that is
    latency-bound at these sizes: 4-7 us per launch split 4 ways on the H200); the fewest weight
    rows per program that still give ~PROGRAMS programs; K steps of up to 1024 that divide K
    (no masks: 16-byte loads); a warp per 256 elements of the slab."""
    block_n = 1
    while block_n < 16 and N // (2 * block_n) >= PROGRAMS:
        block_n *= 2
    block_k = next((b for b in (1024, 512, 256) if K % b == 0), 1024)
    return Bf16GemvConfig(block_n, block_k, max(1, min(8, block_n * block_k // 256)), PROGRAMS, 1)


@triton.jit
def _load_w(w_rows, rk, n_ok, k_end, stride_wk, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """One ``[BLOCK_N, BLOCK_K]`` weight slab at K offsets ``rk``, widened to float32."""
    if EVEN_N and EVEN_K:
        w = tl.load(w_rows + rk[None, :] * stride_wk).to(tl.float32)
    elif EVEN_K:
        w = tl.load(w_rows + rk[None, :] * stride_wk, mask=n_ok[:, None], other=0.0).to(tl.float32)
    else:
        w = tl.load(w_rows + rk[None, :] * stride_wk, mask=n_ok[:, None] & (rk < k_end)[None, :], other=0.0).to(
            tl.float32
        )
    return w


@triton.jit
def _gemv_step(
    acc,
    w,
    rk,
    x_base,
    stride_xm,
    nw_ptr,
    inv,
    rows,
    M,
    k_end,
    x_ty: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN_K: tl.constexpr,
    NORM: tl.constexpr,
):
    """acc[r] += slab w against x's row r at K offsets ``rk`` (normalised first with ``NORM``)."""
    for r in tl.static_range(ROWS):
        if r < M:
            if EVEN_K:
                a = tl.load(x_base + r * stride_xm + rk).to(tl.float32)
            else:
                a = tl.load(x_base + r * stride_xm + rk, mask=rk < k_end, other=0.0).to(tl.float32)
            if NORM:
                a = _round(a * tl.sum(tl.where(rows == r, inv, 0.0), axis=0), x_ty)
                if EVEN_K:
                    g = tl.load(nw_ptr + rk).to(tl.float32)
                else:
                    g = tl.load(nw_ptr + rk, mask=rk < k_end, other=0.0).to(tl.float32)
                a = _round(g * a, x_ty)
            part = tl.sum(w * a[None, :], axis=1)
            acc += tl.where(rows[:, None] == r, part[None, :], 0.0)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    nw_ptr,
    eps,
    M,
    N,
    K,
    K_PER,
    stride_xb,
    stride_xm,
    stride_wb,
    stride_wn,
    stride_wk,
    stride_ob,
    stride_om,
    stride_split,
    final_ptr,
    cnt_ptr,
    stride_fb,
    stride_fm,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    FIXUP: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (n, s, b): output columns n * BLOCK_N.. of stack entry b, K from s * K_PER (whole
    steps); ``out`` is the result (one split) or split s's float32 partial (``stride_split``
    apart). x is contiguous along K. ``NORM``: x's rows RMS-normalised first, as the plugin's
    ``_rms_norm_kernel`` computes them (weight ``nw``, each program summing the whole row).
    ``PDL``: the first weight slab is loaded before waiting for the previous kernel (the weight
    is a module parameter, which no kernel of the step writes), the rest after."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk0 = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    k_first = pid_s * K_PER
    k_end = tl.minimum(K, (pid_s + 1) * K_PER)
    w_rows = w_ptr + pid_b * stride_wb + rn.to(tl.int64)[:, None] * stride_wn
    w_first = _load_w(w_rows, k_first + rk0, n_ok, k_end, stride_wk, EVEN_N, EVEN_K)
    gdc_enter(PDL)
    x_base = x_ptr + pid_b * stride_xb
    x_ty = x_ptr.dtype.element_ty
    inv = tl.zeros([ROWS], tl.float32)
    if NORM:  # 1 / rms of each row over all of K (a few KB, from L2 after the first program)
        for r in tl.static_range(ROWS):
            if r < M:
                sq = tl.zeros([BLOCK_K], tl.float32)
                for k1 in range(0, K, BLOCK_K):
                    a = tl.load(x_base + r * stride_xm + k1 + rk0, mask=k1 + rk0 < K, other=0.0).to(tl.float32)
                    sq += a * a
                inv = tl.where(rows == r, 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps), inv)
    acc = _gemv_step(
        acc, w_first, k_first + rk0, x_base, stride_xm, nw_ptr, inv, rows, M, k_end, x_ty, ROWS, EVEN_K, NORM
    )
    for k0 in range(k_first + BLOCK_K, k_end, BLOCK_K):
        rk = k0 + rk0
        w = _load_w(w_rows, rk, n_ok, k_end, stride_wk, EVEN_N, EVEN_K)
        acc = _gemv_step(acc, w, rk, x_base, stride_xm, nw_ptr, inv, rows, M, k_end, x_ty, ROWS, EVEN_K, NORM)
    # FIXUP only with one stack entry (b == 0): the last split of each column tile sums them in split order
    _gemv_epilogue(
        acc,
        out_ptr + pid_b * stride_ob,
        final_ptr,
        cnt_ptr,
        rows,
        rn,
        n_ok,
        M,
        pid_n,
        pid_s,
        stride_om,
        stride_split,
        stride_fm,
        FIXUP,
    )


def gemv_splits(N: int, K: int, cfg: Bf16GemvConfig, stack: int = 1) -> int:
    """K splits (whole K steps each) so that ~``target_programs`` programs stream the weight."""
    tiles = triton.cdiv(N, cfg.block_n) * stack
    steps = triton.cdiv(K, cfg.block_k)
    return max(1, min(steps, cfg.split or triton.cdiv(cfg.target_programs, tiles)))


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    counters: SplitCounters | None = None,
    cfg: Bf16GemvConfig | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """``out[b] = x[b] @ weight[b]^T`` for ``x [B, M, K]`` (contiguous along K), ``weight
    [B, N, K]`` and ``out [B, M, N]`` (any other strides), ``1 <= M <= GEMV_ROWS``; with ``norm
    = (g [K], eps)`` x's rows RMS-normalised first (B == 1). K splits only for one stack entry
    (B == 1); ``cfg`` None: :func:`dense_config`. Shapes and dtypes are checked by the callers.
    With PDL (``kernels/pdl``) the first weight slab is read before the previous kernel of the
    stream has finished: ``weight`` must not be written by the kernels just before (a module's
    parameter)."""
    B, M, K = x.shape
    N = weight.shape[1]
    cfg = cfg or dense_config(N, K)
    split = gemv_splits(N, K, cfg) if B == 1 else 1
    k_per = triton.cdiv(triton.cdiv(K, cfg.block_k), split) * cfg.block_k
    split = triton.cdiv(K, k_per)
    tiles = triton.cdiv(N, cfg.block_n)
    if split > 1:
        dest = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        d_strides = (0, N, M * N)
    else:
        dest, d_strides = out, (out.stride(0), out.stride(1), 0)
    cnt = counters.get(x.device, tiles) if counters is not None and split > 1 else None
    _gemv_kernel[(tiles, split, B)](
        x, weight, dest, norm[0] if norm else x, float(norm[1]) if norm else 0.0, M, N, K, k_per,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), *d_strides,
        out, cnt if cnt is not None else dest, out.stride(0), out.stride(1),
        ROWS=_pow2(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_N=N % cfg.block_n == 0,
        EVEN_K=K % cfg.block_k == 0, FIXUP=cnt is not None, NORM=norm is not None, **launch_kw(x), num_warps=cfg.warps,
        num_stages=2,
    )  # fmt: skip
    if split > 1 and cnt is None:  # out is [1, M, N]: contiguous in the partials' order when its rows are
        flat = (
            out
            if out.stride(1) == N and out.stride(2) == 1
            else torch.empty(1, M, N, dtype=out.dtype, device=out.device)
        )
        _split_sum_kernel[(triton.cdiv(M * N, 1024),)](dest, flat, M * N, SPLIT=split, BLOCK=1024, num_warps=4)
        if flat is not out:
            out.copy_(flat)
    return out


def _eligible(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    from .invariant import INVARIANT

    return (
        1 <= rows <= GEMV_ROWS and x.dtype in SIXTEEN_BIT and weight.dtype == x.dtype and (x.is_cuda or interpreting())
        and x.device == weight.device and not INVARIANT.get()
    )  # fmt: skip


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counters: SplitCounters | None = None,
    cfg: Bf16GemvConfig | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """``FusedOps.dense_linear``: ``x [..., K] @ weight [N, K]^T`` -> ``[..., N]`` in x's dtype,
    with ``norm = (g, eps)`` of ``rms_norm(x, g, eps)`` (the plugin's norm: one launch fewer);
    the GEMV for 1 to GEMV_ROWS 16-bit rows (not in batch-invariant mode), else the norm kernel
    and ``F.linear``."""
    K = weight.shape[-1]
    if x.shape[-1] != K:
        raise ValueError(f"dense_linear: x has {x.shape[-1]} features, weight expects {K}")
    x2 = x.reshape(-1, K)
    ok = _eligible(x2, weight, x2.shape[0]) and weight.dim() == 2 and weight.stride(-1) == 1
    if norm is not None and (norm[0].shape != (K,) or norm[0].dtype != x.dtype or not norm[0].is_contiguous()):
        ok = False
    if not ok:
        if norm is not None:
            from .fused_elementwise import rms_norm

            x = rms_norm(x, norm[0], norm[1])
        return F.linear(x, weight)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    gemv(x2[None], weight[None], out[None], counters, cfg, norm)
    return out.view(*x.shape[:-1], weight.shape[0])


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``FusedOps.head_linear``: ``einsum("thk,hnk->thn", x [T, H, K], weight [H, N, K])``
    (any strides: MLA's ``W_UK^T`` and ``W_UV`` are views of ``kv_b_proj``'s weight); the GEMV
    for 1 to GEMV_ROWS 16-bit tokens, else torch's einsum."""
    T, H, K = x.shape
    if weight.dim() != 3 or weight.shape[0] != H or weight.shape[2] != K:
        raise ValueError(f"head_linear: weight is {tuple(weight.shape)}, expected [{H}, N, {K}] for x {tuple(x.shape)}")
    if not _eligible(x, weight, T) or 1 not in (weight.stride(1), weight.stride(2)):
        return torch.einsum("thk,hnk->thn", x, weight)
    xs = x.transpose(0, 1)  # [H, T, K]
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    out = torch.empty(T, H, weight.shape[1], dtype=x.dtype, device=x.device)
    gemv(xs, weight, out.transpose(0, 1), None, HEADS_K if weight.stride(2) == 1 else HEADS_N)
    return out

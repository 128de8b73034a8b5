"""FP8 block-scaled GEMV for decode: ``y = x @ dequant(W)^T`` for 1 to :data:`GEMV_ROWS` rows.

Why a separate kernel: at one request the dense FP8 GEMMs are a pure weight read, and the tiled
GEMM (``fp8_gemm``: 16-row MMA tiles, 15 of them padding) read the V3-mini weights at 0.65 TB/s
(H200 profile: 48 launches, 0.32 ms for ~0.21 GB) against ~4 TB/s for a plain copy. Here each
program streams a ``[BLOCK_N, GROUPS * 128]`` slab of the weight per step with 16-byte loads,
widens it in registers and multiplies it on the CUDA cores (no MMA, no padding rows); K is split
over enough programs to keep the memory system busy, the splits summed in split order by the
last program of each column tile (arrival counters, as ``fp8_gemm``'s ``FIXUP``) or by a
separate launch.

Arithmetic is DeepSeek's, as in ``fp8_gemm``: each row's activations quantized to e4m3 per
128-channel group (scale = amax / 448), each group's products (exact in float32) summed, times
the row's and the weight tile's scales, groups and splits summed in float32. Only the order of
the float32 sums differs from the tiled GEMM, so a row's result can differ from it in the last
bits: a batch-invariant forward never comes here (``fp8_linear`` keeps one tiling for every row
count there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fused_elementwise import _round
from .gemm_parts import FP8_BLOCK, SplitCounters, _quant_rows, _split_sum_kernel
from .paged_attention import _pow2, interpreting

# up to this many rows the GEMV replaces the tiled GEMM (bf16 / fp16 activations); measured on
# an H200, V3-mini's 48 dense FP8 launches (benchmarks/kernels/fp8_gemv.py): 1 row 0.250 vs 0.342 ms,
# 2 rows 0.300 vs 0.343, 4 rows 0.431 vs 0.346 (the CUDA-core work grows with the rows)
GEMV_ROWS = 2


@dataclass(frozen=True)
class GemvConfig:
    """Column rows per program, 128-wide groups per K step (the slab is block_n x groups * 128
    bytes), warps, and how many programs K splits should aim for."""

    block_n: int = 16
    groups: int = 8
    warps: int = 8
    target_programs: int = 528  # 4 per H200 SM (the fastest of 9 configs at one row: 0.242 ms a step)
    split: int = 0  # K splits; 0: from target_programs


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    K_PER,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    stride_split,
    final_ptr,
    cnt_ptr,
    stride_fm,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    UPCAST: tl.constexpr,
    FIXUP: tl.constexpr,
):
    """Program (n, s): output columns n * BLOCK_N.., K from s * K_PER (whole groups); ``out`` is
    the result (one split) or split s's float32 partial (``stride_split`` apart)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rg = tl.arange(0, GROUPS)
    rc = tl.arange(0, 128)
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    k_end = tl.minimum(K, (pid_s + 1) * K_PER)
    w_rows = w_ptr + rn.to(tl.int64)[:, None, None] * stride_wn
    for k0 in range(pid_s * K_PER, k_end, GROUPS * 128):
        rk = k0 + rg[:, None] * 128 + rc[None, :]  # [GROUPS, 128]
        k_ok = rk < k_end
        w = tl.load(w_rows + rk[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
        g_ok = k0 + rg * 128 < k_end
        sw = tl.load(
            s_ptr + (rn // 128)[:, None] * stride_sn + (k0 // 128 + rg)[None, :],
            mask=n_ok[:, None] & g_ok[None, :],
            other=0.0,
        )
        for r in tl.static_range(ROWS):
            if r < M:
                a = tl.load(x_ptr + r * stride_xm + rk, mask=k_ok, other=0.0).to(tl.float32)
                q, sa = _quant_rows(a, UPCAST)  # per 128-channel group: [GROUPS, 128], [GROUPS]
                dots = tl.sum(w * q.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_N, GROUPS], exact products
                part = tl.sum(dots * sw * sa[None, :], axis=1)
                acc += tl.where(rows[:, None] == r, part[None, :], 0.0)
    _gemv_epilogue(
        acc, out_ptr, final_ptr, cnt_ptr, rows, rn, n_ok, M, pid_n, pid_s, stride_om, stride_split, stride_fm, FIXUP
    )


@triton.jit
def _gemv_epilogue(
    acc,
    out_ptr,
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
    FIXUP: tl.constexpr,
):
    """A GEMV program's end (this kernel's and ``bf16_gemv``'s): rows ``rows < M`` x columns
    ``rn`` of ``acc`` stored, rounded to ``out``'s dtype, as split ``pid_s``'s result
    (``stride_split`` apart; the result itself when K is not split). ``FIXUP``: the last split of
    column tile ``pid_n`` to arrive (its counter in ``cnt``) sums every split in split order into
    ``final`` and resets the counter."""
    out_ty = out_ptr.dtype.element_ty
    offs = rows[:, None].to(tl.int64) * stride_om + rn[None, :]
    ok = (rows < M)[:, None] & n_ok[None, :]
    tl.store(out_ptr + pid_s.to(tl.int64) * stride_split + offs, _round(acc, out_ty).to(out_ty), mask=ok)
    if FIXUP:
        tl.debug_barrier()  # every thread's partial stored before the arrival is published
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:  # the last split of this column tile: sum in split order
            total = tl.load(out_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for j in range(1, tl.num_programs(1)):
                total += tl.load(out_ptr + j * stride_split + offs, mask=ok, other=0.0, cache_modifier=".cg")
            f_ty = final_ptr.dtype.element_ty
            tl.store(
                final_ptr + rows[:, None].to(tl.int64) * stride_fm + rn[None, :], _round(total, f_ty).to(f_ty), mask=ok
            )
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch (graph replays too)


def gemv_splits(N: int, K: int, cfg: GemvConfig) -> int:
    """K splits (whole K steps each) so that ~``target_programs`` programs stream the weight."""
    tiles = triton.cdiv(N, cfg.block_n)
    steps = triton.cdiv(K, cfg.groups * FP8_BLOCK)
    return max(1, min(steps, cfg.split or triton.cdiv(cfg.target_programs, tiles)))


def fp8_gemv(
    x2: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    out: torch.Tensor,
    counters: SplitCounters | None = None,
    cfg: GemvConfig = GemvConfig(),
) -> torch.Tensor:
    """``out [M, N] = x2 [M, K] @ dequant(weight)^T`` for ``1 <= M <= GEMV_ROWS`` 16-bit rows
    (contiguous along K); shapes are checked by the caller (``fp8_linear``)."""
    M, K = x2.shape
    N = weight.shape[0]
    step = cfg.groups * FP8_BLOCK
    split = gemv_splits(N, K, cfg)
    k_per = triton.cdiv(triton.cdiv(K, step), split) * step
    split = triton.cdiv(K, k_per)
    tiles = triton.cdiv(N, cfg.block_n)
    dest = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
    cnt = counters.get(x2.device, tiles) if counters is not None and split > 1 else None
    _fp8_gemv_kernel[(tiles, split)](
        x2, weight, scale_inv, dest, M, N, K, k_per,
        x2.stride(0), weight.stride(0), scale_inv.stride(0), N if split > 1 else out.stride(0), M * N,
        out, cnt if cnt is not None else dest, out.stride(0),
        ROWS=_pow2(M), BLOCK_N=cfg.block_n, GROUPS=cfg.groups, UPCAST=interpreting(), FIXUP=cnt is not None,
        num_warps=cfg.warps, num_stages=2,
    )  # fmt: skip
    if split > 1 and cnt is None:
        _split_sum_kernel[(triton.cdiv(M * N, 1024),)](dest, out, M * N, SPLIT=split, BLOCK=1024, num_warps=4)
    return out

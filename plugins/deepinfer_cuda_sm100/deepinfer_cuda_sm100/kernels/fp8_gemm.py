"""``y = x @ dequant(W)^T`` for FP8 e4m3 weights with one float32 scale per 128 x 128 tile
(DeepSeek-V3's checkpoint format: ``weight`` + ``weight_scale_inv``).

bf16 / fp16 activations are quantized on the fly as DeepSeek's own inference does: per row and
128-channel group, scale = amax / 448, values in e4m3; each K step (one 128-wide group, the
weight's scale column) is one FP8 MMA whose float32 result is multiplied by the row's and the
output column's scales and added (per-block promotion). Why not widen the weight to bf16 instead:
measured on an H200, the widening between the load and the MMA cost 2-6x against bf16 GEMMs
(the FP8 tile could no longer stream straight into the MMA). float32 activations (the exactness
path) keep their values: the weight is widened and products stay float32.

One tile configuration per row count class; a batch-invariant forward keeps one configuration
for every row count (the rows of a tile never interact, so a row's result then depends on that
row alone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_elementwise import _round
from .gemm_parts import FP8_BLOCK, SplitCounters, _quant_rows, _split_sum_kernel
from .paged_attention import interpreting

# BLOCK_K is always 128: one activation group and one weight scale column per K step.
PREQUANT_ROWS = 128  # from this many rows the activations are quantized once, before the GEMM
FIXUP_ROWS = 16  # up to this many rows a K-split GEMM sums its splits in the same launch


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s, UPCAST: tl.constexpr):
    """[16 rows, one 128-channel group] per program: e4m3 values and the group's scale."""
    rm = tl.program_id(0) * 16 + tl.arange(0, 16)
    rk = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _quant_rows(a, UPCAST)
    tl.store(q_ptr + rm[:, None].to(tl.int64) * stride_q + rk[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rm.to(tl.int64) * stride_s + tl.program_id(1), scale, mask=rm < M)


def act_quant(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [M, K]`` -> (e4m3 ``[M, K]``, float32 scales ``[M, ceil(K/128)]``): one pass, for the
    large-batch GEMMs (quantizing inside their K loops would redo it for every column tile)."""
    M, K = x2.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty(M, -(-K // FP8_BLOCK), dtype=torch.float32, device=x2.device)
    if M:
        _act_quant_kernel[(triton.cdiv(M, 16), scale.shape[1])](
            x2, q, scale, M, K, x2.stride(0), q.stride(0), scale.stride(0), UPCAST=interpreting(), num_warps=4
        )
    return q, scale


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    K_PER,
    stride_xm,
    stride_xs,
    stride_wn,
    stride_sn,
    stride_om,
    stride_split,
    final_ptr,
    cnt_ptr,
    stride_fm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    A_MODE: tl.constexpr,
    FIXUP: tl.constexpr,
):
    """A_MODE 0: float32 x, the weight widened (exact); 1: 16-bit x quantized here per K step
    (few rows: nothing repeats much); 2: x already e4m3 with scales ``xs`` (:func:`act_quant`).
    Program (m, n, s) covers K from s * K_PER; with several splits ``out`` is a float32 partial
    sum per split (``stride_split`` apart), summed in split order by :func:`_split_sum_kernel`,
    or, with ``FIXUP``, by the tile's last program to finish (a per-tile arrival counter in
    ``cnt_ptr``, reset by that program) into ``final_ptr``: the same sum, no second launch."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    out_ptr += pid_s.to(tl.int64) * stride_split
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.minimum(K, (pid_s + 1) * K_PER)
    for k0 in range(pid_s * K_PER, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        a = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
        )
        s = tl.load(s_ptr + (rn // 128) * stride_sn + k0 // 128, mask=n_ok, other=0.0)
        if A_MODE == 0:  # float32 activations: the weight widened exactly, products in float32
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            acc += part * s[None, :]
        else:  # DeepSeek's inference: activations in e4m3 per (row, 128 channels), FP8 MMA
            if A_MODE == 1:
                q, sa = _quant_rows(a.to(tl.float32), UPCAST)
            else:
                q = a
                sa = tl.load(xs_ptr + rm.to(tl.int64) * stride_xs + k0 // 128, mask=m_ok, other=0.0)
            if UPCAST:
                part = tl.dot(q.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(q, w)
            acc += part * sa[:, None] * s[None, :]
    out_ty = out_ptr.dtype.element_ty
    tile_offs = rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tile_ok = m_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + tile_offs, _round(acc, out_ty).to(out_ty), mask=tile_ok)
    if FIXUP:
        tl.debug_barrier()  # every thread's partial stored before the arrival is published
        tile = pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(2) - 1:  # the last split of this tile: sum all in split order
            ws = out_ptr - pid_s.to(tl.int64) * stride_split
            total = tl.load(ws + tile_offs, mask=tile_ok, other=0.0, cache_modifier=".cg")
            for j in range(1, tl.num_programs(2)):
                total += tl.load(ws + j * stride_split + tile_offs, mask=tile_ok, other=0.0, cache_modifier=".cg")
            f_ty = final_ptr.dtype.element_ty
            tl.store(
                final_ptr + rm[:, None].to(tl.int64) * stride_fm + rn[None, :],
                _round(total, f_ty).to(f_ty),
                mask=tile_ok,
            )
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (graph replays too)


def fp8_supported(platform) -> bool:
    """FP8 e4m3 conversions need SM89+ (Ada, Hopper, Blackwell); the interpreter has them too."""
    if interpreting():
        return True
    index = getattr(platform, "index", None) or 0
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index) >= (8, 9)


SPLIT_TARGET = 264  # programs to aim for when few rows leave few output tiles (2 per H200 SM)


def _splits(M: int, N: int, K: int, bm: int, bn: int) -> int:
    """K splits for decode-sized batches: a 1-64 row GEMM has only N / BLOCK_N output tiles, too
    few programs to keep enough weight loads in flight (measured: 48 dense FP8 GEMMs of a
    64-request V3-mini step 1.05 ms vs cuBLAS bf16 ~0.3 ms); each split is whole 128-wide groups."""
    if M > 64:
        return 1
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    return max(1, min(triton.cdiv(K, FP8_BLOCK), SPLIT_TARGET // tiles, 16))


def _config(M: int, N: int, invariant: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Few rows: narrow column tiles so that enough
    programs stream the weight at once (the step is a weight read); many rows: 128-wide tiles."""
    if invariant:
        return 16, 64, 128, 4, 3
    if M <= 16:
        return 16, 64, 128, 4, 3  # with K splits (_splits)
    if M <= 64:  # one row tile, K splits: each weight byte read once, enough programs in flight
        return 64, 64, 128, 4, 3
    if M <= 256:
        return 64, 128, 128, 8, 3
    return 128, 128, 128, 8, 3


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, counters: SplitCounters | None = None
) -> torch.Tensor:
    """``x [..., K]`` (bf16 / fp16 / float32) times ``weight [N, K]`` (float8_e4m3fn) with
    ``scale_inv [ceil(N/128), ceil(K/128)]`` (float32, "multiply") -> ``[..., N]`` in x's dtype
    (16-bit x quantized per row and 128 channels as :func:`quantize_activations` states).
    With ``counters`` a K-split GEMM sums its splits inside the same launch (the plugin's fused
    op passes them: one launch instead of two per decode GEMM); the result is bit-identical."""
    from .invariant import INVARIANT

    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, weight expects {K}")
    want = (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"fp8_linear: scale_inv is {tuple(scale_inv.shape)}, expected {want} for a [{N}, {K}] weight")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        invariant = INVARIANT.get()
        bm, bn, bk, warps, stages = _config(M, N, invariant)
        mode = 0 if x.dtype == torch.float32 else 1 if M < PREQUANT_ROWS or invariant else 2
        if mode == 0:  # 4-byte A tiles: smaller tiles and two stages fit shared memory
            bm, bn, warps, stages = min(bm, 64), min(bn, 64), 4, 2
        if mode == 1 and not invariant and M <= _gemv_rows():  # decode: the weight-read GEMV
            from .fp8_gemv import fp8_gemv

            return fp8_gemv(x2, weight, scale_inv, out, counters).view(*x.shape[:-1], N)
        xs = out  # unused unless mode 2
        if mode == 2:
            x2, xs = act_quant(x2)
        split = 1 if invariant or mode == 0 else _splits(M, N, K, bm, bn)
        k_per = triton.cdiv(triton.cdiv(K, FP8_BLOCK), split) * FP8_BLOCK
        split = triton.cdiv(K, k_per)
        dest = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
        # in-kernel sums only for <= 16 rows: from 17 rows the last program's serial read of every
        # split's 64 x 64 tile cost more than the separate launch (H200, V3-mini FP8 at 64
        # requests: dense FP8 GEMMs 0.61 vs 0.45 ms a step; at 1 request 0.32 vs 0.31 ms with 47
        # fewer launches)
        cnt = (
            counters.get(x.device, grid[0] * grid[1])
            if counters is not None and split > 1 and M <= FIXUP_ROWS
            else None
        )
        _fp8_linear_kernel[grid](
            x2, xs, weight, scale_inv, dest, M, N, K, k_per,
            x2.stride(0), xs.stride(0), weight.stride(0), scale_inv.stride(0), N if split > 1 else out.stride(0), M * N,
            out, cnt if cnt is not None else xs, out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=interpreting(), A_MODE=mode, FIXUP=cnt is not None,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        if split > 1 and cnt is None:
            _split_sum_kernel[(triton.cdiv(M * N, 1024),)](dest, out, M * N, SPLIT=split, BLOCK=1024, num_warps=4)
    return out.view(*x.shape[:-1], N)


def _gemv_rows() -> int:
    from .fp8_gemv import GEMV_ROWS

    return GEMV_ROWS


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch statement of the kernels' activation quantization: ``x [M, K]`` -> (e4m3 values,
    float32 scales ``[M, ceil(K/128)]``), per row and 128-channel group, scale = amax / 448."""
    M, K = x.shape
    groups = torch.nn.functional.pad(x.float(), (0, -K % 128)).view(M, -1, 128)
    scale = groups.abs().amax(-1).clamp_min(1e-12) / 448.0
    q = (groups / scale[..., None]).to(torch.float8_e4m3fn).view(M, -1)[:, :K]
    return q, scale

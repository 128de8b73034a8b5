"""Fused MoE in Triton: tokens sorted by expert and padded to the row tile (the ``moe_align``
approach), then two grouped GEMMs over the sorted rows:

1. gate/up: ``act = silu(x W_gate^T) * (x W_up^T)`` for both halves in one program, so the
   ``[rows, 2I]`` product never reaches memory (SiLU-and-mul fused into the epilogue);
2. down: ``y = act W_down^T`` scaled by the row's routing weight in the epilogue, stored at the
   row's (token, k) place; the k rows of a token are then summed in float32.

Everything is sized from static bounds (``T*k + E*(BLOCK_M-1)`` padded rows) and no step reads
a count back to the host, so the whole layer can be captured in a CUDA graph. Each output row
is computed by the same tile program whatever else is in the batch, and the final sum over a
token's k rows is a fixed-order reduction: results do not depend on the batch's composition
as long as the tile configuration is the same (``choose_block_m`` keeps decode batches on one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .fp8_gemm import PREQUANT_ROWS, act_quant
from .fused_elementwise import _round
from .gemm_parts import _quant_rows
from .mxfp4 import MXFP4_GROUP, _mxfp4_tile
from .paged_attention import interpreting
from .pdl import gdc_enter, launch_kw


@triton.jit
def _tile_of(num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """This program's (row tile, column tile). ``GROUP_M`` 0: row tiles fastest (one column tile
    of one expert's weights shared by consecutive programs); else groups of ``GROUP_M`` row tiles
    walked column tile by column tile, so a group's gathered rows stay in L2 across all column
    tiles instead of being read from memory once per column tile (prefill: ~3,000 rows an expert)."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        return pid % num_tiles_m, pid // num_tiles_m
    per_group = GROUP_M * num_tiles_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_tiles_m - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    total_ptr,
    s_ptr,
    xs_ptr,
    num_rows,
    top_k,
    D,
    I,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    stride_se,
    stride_sn,
    stride_xs,
    limit,
    num_tiles_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    QUANT_A: tl.constexpr,
    PREQ: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
    MXFP4: tl.constexpr = False,
):
    pid_m, pid_n = _tile_of(num_tiles_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    total = tl.load(total_ptr)
    if pid_m * BLOCK_M < total:
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        flat = tl.load(sorted_ptr + rows)
        row_ok = flat < num_rows
        tok = (flat // top_k).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        w_base = w_ptr + e * stride_we
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < D
            a = tl.load(x_ptr + tok[:, None] * stride_xt + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if TMA:  # the copy engine fetches the weight tiles ([E * 2I, D] rows; I % BLOCK_N == 0)
                row0 = (e * 2 * I + pid_n * BLOCK_N).to(tl.int32)
                wg = w_desc.load([row0, k0]).T
                wu = w_desc.load([row0 + I, k0]).T
            elif MXFP4:  # packed e2m1 pairs + UE8M0 per 32 inputs, decoded exactly (kernels/mxfp4.py)
                s_e = s_ptr + e * stride_se
                n64 = n.to(tl.int64)
                wg = _mxfp4_tile(w_base, s_e, n64, n_ok, k0, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K).T
                wu = _mxfp4_tile(w_base, s_e, n64 + I, n_ok, k0, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K).T
            else:
                wg = tl.load(
                    w_base + n[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
                )
                wu = tl.load(
                    w_base + (I + n)[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
                )
            if FP8 and QUANT_A:  # e4m3 activations per (row, 128 channels), FP8 MMAs
                s_base = s_ptr + e * stride_se + k0 // 128
                if PREQ:  # x already e4m3 (act_quant), one scale per token and group
                    q = a
                    sa = tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=row_ok, other=0.0)
                else:
                    q, sa = _quant_rows(a.to(tl.float32), UPCAST)
                if UPCAST:
                    q, wg, wu = q.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                pg = (
                    tl.dot(q, wg)
                    * sa[:, None]
                    * tl.load(s_base + (n // 128) * stride_sn, mask=n_ok, other=0.0)[None, :]
                )
                pu = (
                    tl.dot(q, wu)
                    * sa[:, None]
                    * tl.load(s_base + ((I + n) // 128) * stride_sn, mask=n_ok, other=0.0)[None, :]
                )
            else:
                if UPCAST:
                    a = a.to(tl.float32)
                wg, wu = wg.to(a.dtype), wu.to(a.dtype)  # FP8 / MXFP4 values: exact in any activation dtype
                if IEEE:
                    pg = tl.dot(a, wg, input_precision="ieee")
                    pu = tl.dot(a, wu, input_precision="ieee")
                else:
                    pg = tl.dot(a, wg)
                    pu = tl.dot(a, wu)
                if FP8:  # this K step's tile scales of each output column (BLOCK_K divides 128)
                    s_base = s_ptr + e * stride_se + k0 // 128
                    pg = pg * tl.load(s_base + (n // 128) * stride_sn, mask=n_ok, other=0.0)[None, :]
                    pu = pu * tl.load(s_base + ((I + n) // 128) * stride_sn, mask=n_ok, other=0.0)[None, :]
            acc_g += pg
            acc_u += pu
        # round to the activation dtype first, as the unfused reference does
        gate = _round(acc_g, out_ptr.dtype.element_ty)
        up = _round(acc_u, out_ptr.dtype.element_ty)
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        act = _round(gate / (1.0 + tl.exp(-gate)) * up, out_ptr.dtype.element_ty)
        tl.store(
            out_ptr + rows[:, None].to(tl.int64) * stride_ot + n[None, :],
            act.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & n_ok[None, :],
        )


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    h_desc,
    w_desc,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    total_ptr,
    s_ptr,
    hs_ptr,
    num_rows,
    D,
    I,
    stride_ht,
    stride_we,
    stride_wn,
    stride_ot,
    stride_se,
    stride_sn,
    stride_hs,
    num_tiles_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
    QUANT_A: tl.constexpr,
    PREQ: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
    MXFP4: tl.constexpr = False,
):
    pid_m, pid_n = _tile_of(num_tiles_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    total = tl.load(total_ptr)
    if pid_m * BLOCK_M < total:
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        flat = tl.load(sorted_ptr + rows)
        row_ok = flat < num_rows
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < D
        w_base = w_ptr + e * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < I
            if TMA:  # both tiles by the copy engine: the sorted rows are contiguous (a padding row's
                # unwritten values reach only its own output row, which is never stored)
                a = h_desc.load([(pid_m * BLOCK_M).to(tl.int32), k0])
                w = w_desc.load([(e * D + pid_n * BLOCK_N).to(tl.int32), k0]).T
            else:
                a = tl.load(
                    h_ptr + rows[:, None].to(tl.int64) * stride_ht + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                if MXFP4:
                    s_e = s_ptr + e * stride_se
                    w = _mxfp4_tile(w_base, s_e, n.to(tl.int64), n_ok, k0, I, stride_wn, stride_sn, BLOCK_N, BLOCK_K).T
                else:
                    w = tl.load(
                        w_base + n[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
                    )
            if FP8 and QUANT_A:
                if PREQ:
                    q = a
                    sa = tl.load(hs_ptr + rows.to(tl.int64) * stride_hs + k0 // 128, mask=row_ok, other=0.0)
                else:
                    q, sa = _quant_rows(a.to(tl.float32), UPCAST)
                if UPCAST:
                    q, w = q.to(tl.float32), w.to(tl.float32)
                ws = tl.load(s_ptr + e * stride_se + (n // 128) * stride_sn + k0 // 128, mask=n_ok, other=0.0)
                part = tl.dot(q, w) * sa[:, None] * ws[None, :]
            else:
                if UPCAST:
                    a = a.to(tl.float32)
                w = w.to(a.dtype)
                if IEEE:
                    part = tl.dot(a, w, input_precision="ieee")
                else:
                    part = tl.dot(a, w)
                if FP8:
                    part = (
                        part
                        * tl.load(s_ptr + e * stride_se + (n // 128) * stride_sn + k0 // 128, mask=n_ok, other=0.0)[
                            None, :
                        ]
                    )
            acc += part
        # the product rounded to the activation dtype, as the unfused reference rounds it; the
        # routing weight is applied in the sum (half the bytes of float32 rows in 16-bit models)
        tl.store(
            out_ptr + flat[:, None].to(tl.int64) * stride_ot + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & n_ok[None, :],
        )


@triton.jit
def _sum_rows_kernel(
    rows_ptr,
    weights_ptr,
    add_ptr,
    out_ptr,
    D,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_ADD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[t] = ((r0 + r1) + r2) + ... in float32, as the unfused loop added them; with
    ``HAS_W`` each row is first widened and times its routing weight (r_j = y_j w_j, the product
    rounded to float32 before the add: launched without FMA fusion); with ``HAS_ADD`` the row
    ``add[t]`` (the shared expert's output) is the last addend, before the one rounding."""
    gdc_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < D
    acc = tl.load(rows_ptr + t * K * D + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_W:
        acc = acc * tl.load(weights_ptr + t * K)
    for j in tl.static_range(1, K):
        r = tl.load(rows_ptr + (t * K + j) * D + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            r = r * tl.load(weights_ptr + t * K + j)
        acc = acc + r
    if HAS_ADD:
        acc = acc + tl.load(add_ptr + t * D + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs, _round(acc, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=m)


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 0  # program order (_tile_of): 0 row tiles fastest, else groups of this many row tiles
    tma: bool = False  # 16-bit weights: tiles fetched by the copy engine (_descriptors says where it applies)


def choose_config(num_rows: int, num_experts: int) -> MoEConfig:
    """The gate/up GEMM's tiles: 16 rows while experts get few rows each (decode), 64 for
    mid-sized batches, 128 x 128 once experts average 256+ rows, in groups of 8 row tiles, the
    weight tiles fetched by the copy engine (benchmarks/kernels/moe_tiles.py --split on an H200, V3-mini
    64 x 512 prefill: 2.76 ms vs 3.06 ms with row tiles fastest; with ``tma`` 2.60 vs 2.74 ms;
    128 x 128 was the best of 36 tilings before)."""
    if num_rows <= 64 * num_experts:
        return MoEConfig(16, 64, 64, 4, 3)
    if num_rows <= 256 * num_experts:
        return MoEConfig(64, 128, 64, 8, 3)
    return MoEConfig(128, 128, 64, 8, 3, group_m=8, tma=True)


def choose_down_config(num_rows: int, num_experts: int) -> MoEConfig:
    """The down GEMM's tiles (K is the expert width, N the hidden size), same block_m as
    :func:`choose_config`: 128 x 128 in groups of 8 row tiles for prefill-sized batches, both
    operands fetched by the copy engine (moe_tiles.py --split on an H200: 1.30 ms vs 1.40 ms
    for pointer loads at 128 x 256, which had beaten 128 x 128 with row tiles fastest, 1.42 vs
    1.91 ms; with ``tma`` 128 x 128 and 128 x 256 were within 0.02 ms of each other)."""
    if num_rows <= 256 * num_experts:
        return choose_config(num_rows, num_experts)
    return MoEConfig(128, 128, 64, 8, 3, group_m=8, tma=True)


DECODE_ROWS_PER_EXPERT = 8  # 16-bit decode batches up to this many rows an expert take the tiles below
# benchmarks/kernels/decode64_sweep.py, H200, V3-mini's 64-request decode shape (384 rows over 64 experts),
# whole fused_moe 0.221 ms with the 16 x 64 x 64 pointer-load tiles: gate/up with 128-wide K steps
# fetched by the copy engine 0.212 ms, down with 128-wide K steps 0.217 ms; results bit-equal
DECODE_GATE_UP = MoEConfig(16, 64, 128, 4, 3, tma=True)
DECODE_DOWN = MoEConfig(16, 64, 128, 4, 3)


def decode_configs(
    num_rows: int, num_experts: int, hidden: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor | None
) -> tuple[MoEConfig, MoEConfig] | None:
    """``(gate/up, down)`` tiles for a decode-sized batch of 16-bit activations and experts of
    their dtype (few rows an expert: the GEMMs stream the expert weights, so deeper K steps keep
    more bytes in flight), or None: FP8 experts (``_fp8_tiles``), float32 activations (wider A
    tiles, more shared memory) and larger batches keep :func:`choose_config`."""
    wide = hidden.dtype in (torch.bfloat16, torch.float16) and gate_up.dtype == hidden.dtype
    if gate_up_scale is None and wide and num_rows <= DECODE_ROWS_PER_EXPERT * num_experts:
        return DECODE_GATE_UP, DECODE_DOWN
    return None


@dataclass(frozen=True)
class Alignment:
    """Rows of ``topk_ids.flatten()`` grouped by expert, each group padded to ``block_m``."""

    sorted_rows: torch.Tensor  # [padded] int32: index into the T*k rows, num_rows where padding
    block_expert: torch.Tensor  # [padded // block_m] int32: the expert of each row tile
    total: torch.Tensor  # [1] int32: rows in use (padding included), read on the device only
    counts: torch.Tensor  # [E] int64: rows per expert


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ptr,
    total_ptr,
    counts_ptr,
    num_rows,
    capacity,
    num_experts,
    BLOCK_M: tl.constexpr,
    E_P: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """moe_align for decode-sized batches, one program per expert (~25 small torch launches per
    MoE layer become one): every program counts the rows of every expert (the ids are a few KB,
    read from L2) to find where its padded run starts, then writes its own rows in row order (the
    stable sort's order), its run's padding and its row tiles' owner; the last program also fills
    the unused tail. The programs write disjoint slots, so no step waits for another (one program
    walking every row serially took 11 us a layer at 384 rows on an H200)."""
    me = tl.program_id(0)
    experts = tl.arange(0, E_P)
    counts = tl.zeros([E_P], tl.int32)
    for c0 in range(0, num_rows, CHUNK):  # rows per expert
        r = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + r, mask=r < num_rows, other=E_P)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    mine = experts == me
    start = tl.sum(tl.where(mine, padded_end - padded, 0), axis=0)
    end = tl.sum(tl.where(mine, padded_end, 0), axis=0)
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    seen = count * 0
    for c0 in range(0, num_rows, CHUNK):  # my rows, ranks carried across chunks
        r = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + r, mask=r < num_rows, other=E_P)
        hit = (e == me).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit + seen
        tl.store(sorted_ptr + start + rank, r.to(tl.int32), mask=hit > 0)
        seen += tl.sum(hit, axis=0)
    pad = start + count + tl.arange(0, BLOCK_M)  # the run's padding: fewer than BLOCK_M rows
    tl.store(sorted_ptr + pad, tl.full([BLOCK_M], 0, tl.int32) + num_rows, mask=pad < end)
    for t0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):  # my row tiles
        t = t0 + tl.arange(0, CHUNK)
        tl.store(expert_ptr + t, tl.full([CHUNK], 0, tl.int32) + me, mask=t < end // BLOCK_M)
    tl.store(counts_ptr + me, count.to(tl.int64))
    if me == num_experts - 1:  # the tail past the last run: padding rows, owned by the last expert
        for f0 in range(total, capacity, FILL):
            f = f0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + f, tl.full([FILL], 0, tl.int32) + num_rows, mask=f < capacity)
            tile = f // BLOCK_M
            tl.store(expert_ptr + tile, tl.full([FILL], 0, tl.int32) + me, mask=(f < capacity) & (f % BLOCK_M == 0))
        tl.store(total_ptr, total)


ALIGN_MAX_ROWS = 2048  # the Triton kernel up to here (decode batches); larger batches sort with torch


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the T*k (token, choice) rows by expert and pad each expert's run to ``block_m``,
    with no host read-back (capturable in a CUDA graph): one Triton launch for decode-sized
    batches (a program per expert), tensor ops otherwise (the same result)."""
    num_rows = topk_ids.numel()
    if 0 < num_rows <= ALIGN_MAX_ROWS and num_experts <= 256:
        flat = topk_ids.reshape(-1)  # int64 ids read as they are (no cast launch)
        if flat.dtype not in (torch.int32, torch.int64):
            flat = flat.to(torch.int32)
        capacity = -(-(num_rows + num_experts * (block_m - 1)) // block_m) * block_m
        sorted_rows = torch.empty(capacity, dtype=torch.int32, device=flat.device)
        block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device)
        total = torch.empty(1, dtype=torch.int32, device=flat.device)
        counts = torch.empty(num_experts, dtype=torch.long, device=flat.device)
        _align_kernel[(num_experts,)](
            flat, sorted_rows, block_expert, total, counts, num_rows, capacity, num_experts,
            BLOCK_M=block_m, E_P=max(16, triton.next_power_of_2(num_experts)), CHUNK=128 if num_rows > 64 else 64,
            FILL=256, num_warps=4,
        )  # fmt: skip
        return Alignment(sorted_rows, block_expert, total, counts)
    return moe_align_torch(topk_ids, num_experts, block_m)


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """:func:`moe_align` in torch ops (any batch size). The stable sort runs on two-byte keys
    (two radix passes instead of eight for int64: 0.43 ms of the H200's V3-mini prefill was 56
    sort passes), and the counts come from the sorted keys' boundaries (no atomic add of
    200,000 ones into 64 bins, which cost 0.33 ms there)."""
    flat = topk_ids.reshape(-1).long()
    num_rows = flat.numel()
    dev = flat.device
    keys = flat.to(torch.int16) if num_experts < 2**15 else flat
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(num_experts + 1, device=dev, dtype=keys.dtype))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = bounds[:-1]
    sorted_ids = sorted_keys.long()
    rank = torch.arange(num_rows, device=dev) - start[sorted_ids]
    capacity = -(-(num_rows + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_rows = torch.full((capacity,), num_rows, dtype=torch.int32, device=dev)
    sorted_rows[padded_start[sorted_ids] + rank] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True).clamp_max(num_experts - 1).to(torch.int32)
    return Alignment(sorted_rows, block_expert, padded_end[-1:].to(torch.int32), counts)


def _fp8_tiles(config: MoEConfig, explicit: bool, num_rows: int, quant_a: bool) -> MoEConfig:
    """One 128-channel activation group and weight scale column per K step."""
    if config.block_m == 16 and not explicit:  # benchmarks/kernels/moe_tiles.py --fp8 --decode, H200, 64 tokens:
        # 16 x 128 x 128 0.150 ms vs 16 x 32 0.240 ms; tiny batches keep 32 for more programs
        config = replace(config, block_n=128 if num_rows > 32 else 32)
    config = replace(config, block_k=128)
    if not quant_a:  # float32 activations: 4-byte A tiles, so narrower and two stages (shared memory)
        config = replace(config, block_n=min(config.block_n, 64), num_stages=2)
    return config


def fused_moe(
    hidden: torch.Tensor,  # [T, D]
    gate_up: torch.Tensor,  # [E, 2I, D] (MXFP4: uint8 [E, 2I, D/2])
    down: torch.Tensor,  # [E, D, I] (MXFP4: uint8 [E, D, I/2])
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k] float32
    swiglu_limit: float | None = None,
    config: MoEConfig | None = None,
    gate_up_scale: torch.Tensor | None = None,  # [E, 2I/128, ceil(D/128)] float32: FP8 (MXFP4: uint8 [E, 2I, D/32])
    down_scale: torch.Tensor | None = None,  # [E, ceil(D/128), ceil(I/128)] float32 (MXFP4: uint8 [E, D, I/32])
    down_config: MoEConfig | None = None,  # the down GEMM's tiles (same block_m); default: config's
    addend: torch.Tensor | None = None,  # [T, D]: added to each token's sum before its rounding
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(sum_k w_k * expert_k(x) per token [T, D] in hidden.dtype, rows per expert [E])``
    (the counts are None for the per-row GEMV path inside a CUDA-graph capture).

    With ``gate_up_scale`` / ``down_scale`` the expert weights are float8_e4m3fn in DeepSeek's
    128 x 128 block format; 16-bit activations (the input and the SiLU-and-mul output) are then
    quantized per row and 128 channels and multiplied in FP8, as ``fp8_gemm`` does; float32
    activations multiply the widened weights.

    uint8 experts are MXFP4 (``deepinfer_core.models.mxfp4``: two e2m1 codes a byte, UE8M0
    exponents per 32 inputs as the scales): each weight tile is decoded in the kernel
    (``kernels/mxfp4.py``, exact) and multiplied in the activation dtype, as 16-bit experts are."""
    T, D = hidden.shape
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    num_rows = T * k
    explicit = config is not None
    decode = (
        None if explicit or down_config is not None else decode_configs(num_rows, E, hidden, gate_up, gate_up_scale)
    )
    if decode is not None:
        config, down_config = decode
    if down_config is None:  # FP8 and float32 (wider A tiles, more shared memory) keep one tiling
        plain16 = gate_up_scale is None and hidden.dtype != torch.float32
        down_config = config or (choose_down_config(num_rows, E) if plain16 else choose_config(num_rows, E))
    config = config or choose_config(num_rows, E)
    if down_config.block_m != config.block_m:
        raise ValueError(
            f"fused_moe: down_config.block_m ({down_config.block_m}) must equal config.block_m ({config.block_m}): "
            "both GEMMs walk one alignment"
        )
    mxfp4 = gate_up.dtype == torch.uint8
    fp8 = gate_up_scale is not None and not mxfp4
    if (gate_up_scale is not None) != (down_scale is not None) or (fp8 and inter % 128):
        raise ValueError("fused_moe: FP8 experts need both scale grids and I a multiple of 128")
    if mxfp4:
        _check_mxfp4(hidden, gate_up, down, gate_up_scale, down_scale, config, down_config)
    quant_a = fp8 and hidden.dtype != torch.float32  # 16-bit activations go e4m3 (fp8_gemm)
    if fp8:
        config = _fp8_tiles(config, explicit, num_rows, quant_a)
        down_config = _fp8_tiles(down_config, explicit, num_rows, quant_a)
    if _use_gemv(explicit, num_rows, hidden, gate_up):  # a few decode rows: per-row GEMVs, no alignment
        from .moe_gemv import moe_gemv

        rows_out = moe_gemv(
            hidden.contiguous(), gate_up, down, topk_ids, topk_weights, swiglu_limit, gate_up_scale, down_scale
        )
        return _sum_rows(rows_out, hidden, k, addend=addend), _counts(topk_ids, E)
    preq = quant_a and num_rows >= PREQUANT_ROWS * 8  # large batches: quantize once, not per tile
    scaled = fp8 or mxfp4
    gs = gate_up_scale if scaled else topk_weights  # any tensor: the pointer is unused without scales
    ds = down_scale if scaled else topk_weights
    align = moe_align(topk_ids, E, config.block_m)
    hidden = hidden.contiguous()
    upcast = interpreting() and hidden.dtype != torch.float32
    ieee = hidden.dtype == torch.float32 or interpreting()
    act = torch.empty(align.sorted_rows.numel(), inter, dtype=hidden.dtype, device=hidden.device)
    x_in, x_scale = act_quant(hidden) if preq else (hidden, gs)
    tiles = align.block_expert.numel()
    gu_desc = _descriptors(config, fp8, hidden, gate_up, inter)
    _gate_up_kernel[(tiles * triton.cdiv(inter, config.block_n),)](
        x_in, gate_up, gate_up if gu_desc is None else gu_desc, act, align.sorted_rows, align.block_expert, align.total,
        gs, x_scale, num_rows, k, D, inter,
        x_in.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), gs.stride(0),
        gs.stride(1) if scaled else 0, x_scale.stride(0), float(swiglu_limit or 0.0), tiles,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        HAS_LIMIT=swiglu_limit is not None, UPCAST=upcast, IEEE=ieee, FP8=fp8, QUANT_A=quant_a, PREQ=preq,
        GROUP_M=config.group_m, TMA=gu_desc is not None, MXFP4=mxfp4, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    # each (token, choice) row's expert output in the activation dtype (rounded as the reference
    # rounds it); the routing weights are applied in the fixed-order sum
    rows_out = torch.empty(num_rows, D, dtype=hidden.dtype, device=hidden.device)
    h_in, h_scale = act_quant(act) if preq else (act, gs)
    dc = down_config
    dn_desc = _descriptors(dc, fp8, hidden, down, D)
    h_desc = (
        _descriptors(replace(dc, block_n=dc.block_m), fp8, hidden, act, dc.block_m) if dn_desc is not None else None
    )
    _down_kernel[(tiles * triton.cdiv(D, dc.block_n),)](
        h_in, down, down if h_desc is None else h_desc, down if dn_desc is None else dn_desc, rows_out,
        align.sorted_rows, align.block_expert, align.total, ds, h_scale, num_rows, D, inter,
        h_in.stride(0), down.stride(0), down.stride(1), rows_out.stride(0), ds.stride(0), ds.stride(1) if scaled else 0,
        h_scale.stride(0), tiles, BLOCK_M=dc.block_m, BLOCK_N=dc.block_n, BLOCK_K=dc.block_k, UPCAST=upcast, IEEE=ieee,
        FP8=fp8, QUANT_A=quant_a, PREQ=preq, GROUP_M=dc.group_m, TMA=dn_desc is not None and h_desc is not None,
        MXFP4=mxfp4, num_warps=dc.num_warps, num_stages=dc.num_stages,
    )  # fmt: skip
    return _sum_rows(rows_out, hidden, k, topk_weights, addend), align.counts


def mxfp4_moe(
    hidden: torch.Tensor,  # [T, D]
    experts,  # deepinfer_core.moe.ExpertWeights holding MXFP4 (uint8) weights and exponents
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k] float32
    swiglu_limit: float | None = None,
) -> torch.Tensor:  # [T, D] in hidden's dtype
    """``FusedOps.mxfp4_moe``: the routed experts' weighted sum on packed MXFP4 weights (offering
    it makes the engine keep them packed; :class:`~deepinfer_cuda_sm100.moe.TritonMoEDispatcher`
    runs them through :func:`fused_moe` the same way)."""
    if not experts.is_mxfp4:
        raise ValueError(f"mxfp4_moe: experts are {experts.gate_up.dtype}, not packed MXFP4 (uint8)")
    out, _ = fused_moe(
        hidden, experts.gate_up, experts.down, topk_ids, topk_weights, swiglu_limit,
        gate_up_scale=experts.gate_up_scale, down_scale=experts.down_scale,
    )  # fmt: skip
    return out


def _check_mxfp4(hidden, gate_up, down, gate_up_scale, down_scale, config, down_config) -> None:
    """MXFP4 experts: packed halves of the hidden size and width, one exponent byte per 32
    inputs, contiguous rows, and K steps of whole groups."""
    E, two_i, half_d = gate_up.shape
    D, inter = hidden.shape[1], two_i // 2
    want = {
        "gate_up": ((E, two_i, D // 2), gate_up), "down": ((E, D, inter // 2), down),
        "gate_up_scale": ((E, two_i, D // MXFP4_GROUP), gate_up_scale),
        "down_scale": ((E, D, inter // MXFP4_GROUP), down_scale),
    }  # fmt: skip
    for name, (shape, t) in want.items():
        if t is None or t.dtype != torch.uint8 or tuple(t.shape) != shape or t.stride(-1) != 1:
            got = None if t is None else (t.dtype, tuple(t.shape))
            raise ValueError(f"fused_moe: MXFP4 {name} must be contiguous uint8 {shape}, got {got}")
    if D % MXFP4_GROUP or inter % MXFP4_GROUP:
        raise ValueError(f"fused_moe: MXFP4 needs hidden ({D}) and width ({inter}) multiples of {MXFP4_GROUP}")
    for c in (config, down_config):
        if c is not None and c.block_k % MXFP4_GROUP:
            raise ValueError(f"fused_moe: MXFP4 K steps must be whole groups of {MXFP4_GROUP}, got {c.block_k}")


def _descriptors(config: MoEConfig, fp8: bool, hidden: torch.Tensor, rows: torch.Tensor, n_span: int):
    """A copy-engine descriptor over ``rows`` (contiguous; its leading dimensions flattened) in
    ``[block_n, block_k]`` tiles, or None
    where ``config.tma`` is off or does not apply: FP8 experts and float32 activations keep the
    pointer loads, and a tile must not cross into the next span of ``n_span`` rows (the up half,
    the next expert), which the copy engine could not mask (``n_span % block_n``); its row pitch
    and base need 16-byte alignment."""
    if not config.tma or fp8 or hidden.dtype not in (torch.bfloat16, torch.float16) or rows.dtype != hidden.dtype:
        return None
    if (
        n_span % config.block_n
        or not rows.is_contiguous()
        or (rows.shape[-1] * rows.element_size()) % 16
        or rows.data_ptr() % 16
    ):
        return None
    rows = rows.reshape(-1, rows.shape[-1])
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(rows, [config.block_n, config.block_k])


def _sum_rows(
    rows_out: torch.Tensor,
    hidden: torch.Tensor,
    k: int,
    weights: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """A token's k rows summed in float32 in a fixed order, whatever the batch; one launch, not
    2k-1. ``weights [T, k]``: rows are unweighted expert outputs, each times its routing weight
    first; None: rows already weighted (float32). ``addend [T, D]``: added last, before the
    rounding."""
    T, D = hidden.shape
    out = torch.empty(T, D, dtype=hidden.dtype, device=hidden.device)
    if T:
        block = min(1024, triton.next_power_of_2(D))
        w = weights.reshape(-1).float().contiguous() if weights is not None else rows_out
        add = addend.contiguous() if addend is not None else rows_out
        _sum_rows_kernel[(T, triton.cdiv(D, block))](
            rows_out, w, add, out, D, K=k, BLOCK=block, HAS_W=weights is not None, HAS_ADD=addend is not None,
            **launch_kw(rows_out), num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def _use_gemv(explicit: bool, num_rows: int, hidden: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """The per-row GEMVs (``moe_gemv``) for 1 to MOE_GEMV_ROWS rows of 16-bit activations with
    FP8, MXFP4 or same-dtype experts; an explicit tiling (batch-invariant forwards, tile sweeps) and
    float32 activations keep the grouped GEMMs."""
    from .moe_gemv import MOE_GEMV_ROWS

    wide = hidden.dtype in (torch.bfloat16, torch.float16)
    return (
        not explicit
        and 0 < num_rows <= MOE_GEMV_ROWS
        and wide
        and gate_up.dtype in (hidden.dtype, torch.float8_e4m3fn, torch.uint8)  # uint8: MXFP4
    )


def _counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor | None:
    """Rows per expert [E] int64 without the alignment; None inside a CUDA-graph capture (the
    dispatcher counts only eager steps: two launches a layer saved in the replayed step)."""
    if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    ids = topk_ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))

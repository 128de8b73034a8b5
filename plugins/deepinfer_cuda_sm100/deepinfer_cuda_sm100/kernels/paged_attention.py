"""Paged attention in Triton: one kernel for prefill (varlen, causal, over a cached prefix),
chunked prefill and decode, for full/GQA/sliding attention and absorbed MLA (one latent head,
V a prefix of K), with split-KV for decode.

It reads the core's reference cache layout unchanged (``[planes, Hkv, blocks, block_size, W]``,
see ``deepinfer_core.attention.torch_ref``), so the reference ``write_kv`` fills it and the two
backends can be swapped on one cache.

One program handles a tile of ``BLOCK_M`` query rows of one request and one KV head: row ``i``
is token ``i // G`` of the tile, query head ``kv_head * G + i % G`` (``G`` query heads per KV
head), so a GQA/MQA group shares every K/V load. Keys are visited ``BLOCK_N`` at a time; each
key's page comes from the block table, so any block size works. The head dimension is split
into a power-of-two part and a tail (MLA: 512 latent + 64 rope) instead of padding 576 to 1024.

Split-KV: the key range of a tile is cut into ``num_splits`` equal runs of whole ``BLOCK_N``
tiles; each split writes a normalised partial output and its log-sum-exp, merged afterwards.
The split count depends only on what the caller passes (never on the data), and batch-invariant
callers pass one fixed configuration, so a request's arithmetic never depends on its batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import gdc_enter, launch_kw


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    bt_ptr,
    qsl_ptr,
    seqlen_ptr,
    out_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_bt,
    scale,
    block_size,
    window,
    tiles_per_req,
    num_splits,
    G: tl.constexpr,
    TPT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DA: tl.constexpr,
    DA_OK: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DV: tl.constexpr,
    V_PLANE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    gdc_enter(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r = pid // tiles_per_req
    t = pid % tiles_per_req
    q_start = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - q_start
    if t * TPT < qlen:
        seq_len = tl.load(seqlen_ptr + r)
        ctx = seq_len - qlen
        rows = tl.arange(0, BLOCK_M)
        tok = t * TPT + rows // G
        head = kvh * G + rows % G
        row_ok = (rows < TPT * G) & (tok < qlen)
        qpos = ctx + tok

        da = tl.arange(0, DA)
        q_rows = q_ptr + (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        qa = tl.load(q_rows[:, None] + da[None, :], mask=row_ok[:, None] & (da < DA_OK)[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter computes bf16 dots wrongly: test them in float32
            qa = qa.to(tl.float32)
        if BLOCK_DB > 0:
            db = tl.arange(0, BLOCK_DB)
            qb = tl.load(q_rows[:, None] + DA + db[None, :], mask=row_ok[:, None] & (db < DB)[None, :], other=0.0).to(
                qa.dtype
            )
        dv = tl.arange(0, BLOCK_DV)

        last = tl.minimum(qlen, (t + 1) * TPT) - 1
        hi = ctx + last + 1
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(0, ctx + t * TPT - window + 1)
        n_tiles = tl.cdiv(hi - lo, BLOCK_N)
        per_split = tl.cdiv(n_tiles, num_splits)
        s_lo = lo + split * per_split * BLOCK_N
        s_hi = tl.minimum(hi, s_lo + per_split * BLOCK_N)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        head_base = cache_ptr + kvh.to(tl.int64) * stride_ch  # int32 wraps once a plane holds 2^31 elements
        for start in range(s_lo, s_hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            k_ok = kpos < s_hi
            page = tl.load(bt_ptr + r * stride_bt + kpos // block_size, mask=k_ok, other=0)
            slot = page.to(tl.int64) * block_size + kpos % block_size
            k_rows = head_base + slot * stride_cs
            ka = tl.load(k_rows[:, None] + da[None, :], mask=k_ok[:, None] & (da < DA_OK)[None, :], other=0.0).to(
                qa.dtype
            )
            if IEEE:
                s = tl.dot(qa, tl.trans(ka), input_precision="ieee")
            else:
                s = tl.dot(qa, tl.trans(ka))
            if BLOCK_DB > 0:
                kb = tl.load(k_rows[:, None] + DA + db[None, :], mask=k_ok[:, None] & (db < DB)[None, :], other=0.0).to(
                    qa.dtype
                )
                if IEEE:
                    s += tl.dot(qb, tl.trans(kb), input_precision="ieee")
                else:
                    s += tl.dot(qb, tl.trans(kb))
            s = s * scale
            allowed = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_rows = head_base + V_PLANE * stride_cp + slot * stride_cs
            v = tl.load(v_rows[:, None] + dv[None, :], mask=k_ok[:, None] & (dv < DV)[None, :], other=0.0).to(qa.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(qa.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(qa.dtype), v)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_ptrs = (
            out_ptr
            + split * stride_os
            + (q_start + tok).to(tl.int64)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dv[None, :]
        )
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])
        if SPLIT:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
            tl.store(lse_ptr + split * stride_ls + (q_start + tok) * stride_lt + head, lse, mask=row_ok)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and split count of one launch (all compile-time except the split count's
    effect on the grid)."""

    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    """Running in Triton's CPU interpreter (``TRITON_INTERPRET=1``, the CI path)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def head_split(head_dim: int) -> tuple[int, int, int]:
    """``(DA, BLOCK_DB, DB)``: the largest power of two <= head_dim (at least 16: a narrower
    ``tl.dot`` compiles in the interpreter but not for the GPU; the kernel masks channels past
    ``head_dim``), and the tail padded to a power of two (at least 16; 0 when there is no tail)."""
    if head_dim < 16:
        return 16, 0, 0
    da = 1 << (head_dim.bit_length() - 1)
    db = head_dim - da
    return da, (max(16, _pow2(db)) if db else 0), db


FLOAT32_TILE = 64 * 256  # query-tile elements (rows x head_dim) that fit one SM's shared memory in float32
FLOAT32_OUT_TILE = 128 * 1024  # bytes of a float32 output tile (rows x v width) that still leave room


def head_chunk(groups: int, head_dim: int, v_head_dim: int, element_size: int, split: bool) -> int:
    """Query heads one launch may take per KV head. A program holds every query head of its KV
    head, and a group too wide does not fit an SM's shared memory (an H200's 227 KiB), so such
    groups run as several launches. Measured with Triton's SM90 compiler and on the H200:
    float32 queries: MLA's 576 channels at 128 heads (DeepSeek-V3's shape) need 451 KiB, 64 x 256
    takes 213 KiB; a float32 output tile (split-KV partials, float32 queries) is staged whole in
    shared memory: bf16 MLA at 128 heads decoding with split-KV needed 256 KiB for its 128 x 512
    partials, while without splits (bf16 output) it takes 180 KiB."""
    out_bytes = 4 if split or element_size >= 4 else element_size
    rows = FLOAT32_OUT_TILE // (max(16, _pow2(v_head_dim)) * out_bytes)
    if element_size >= 4:
        rows = min(rows, FLOAT32_TILE // head_dim)
    if _pow2(groups) <= rows:
        return groups
    return max(1, 1 << (rows.bit_length() - 1))


def choose_config(
    groups: int,
    head_dim: int,
    max_query_len: int,
    num_programs: int,
    max_seq_len: int,
    batch_invariant: bool,
    sms: int = 132,
    element_size: int = 2,
) -> LaunchConfig:
    """A launch configuration from shapes only. Batch-invariant mode always returns the same
    one for a layer (so a request computes identically alone and in any batch)."""
    wide = head_dim > 256
    block_n = 32 if wide else 64
    warps, stages = (8, 2) if wide else (4, 2)
    if batch_invariant:
        return LaunchConfig(max(16, _pow2(groups)), block_n, 1, warps, stages)
    if max_query_len == 1:
        splits = 1
        if num_programs < sms:
            splits = max(1, min(16, -(-2 * sms // max(num_programs, 1)), -(-max_seq_len // 256)))
        block_m = max(16, _pow2(groups))
        if (
            wide and block_m == 16 and num_programs >= 64 and element_size == 2
        ):  # 16-bit MLA at 16 heads, 64+ requests: 4 warps
            # (benchmarks/kernels/decode64_sweep.py, H200, 64 requests x 161 tokens of V3-mini: 0.0132-0.0135
            # ms at 3-4 splits vs 0.0195 ms with 8 warps, merge included)
            warps = 4
        return LaunchConfig(block_m, block_n, splits, warps, stages)
    return LaunchConfig(max(32 if wide else 64, _pow2(groups)), block_n, 1, warps, stages)


def paged_attention(
    q: torch.Tensor,  # [T, H, head_dim]
    kv_cache: torch.Tensor,  # [planes, Hkv, blocks, block_size, W]
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R+1] int32
    seq_lens: torch.Tensor,  # [R] int32
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    v_head_dim: int,
    kv_shared: bool,
    window: int | None = None,
    batch_invariant: bool = False,
    config: LaunchConfig | None = None,
) -> torch.Tensor:  # [T, H, v_head_dim] in q.dtype
    """Causal attention of each request's new tokens over its paged context (already written)."""
    T, H, D = q.shape
    planes, hkv, _blocks, block_size, _w = kv_cache.shape
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged_attention: q and kv_cache need a contiguous last dimension")
    groups = H // hkv
    R = seq_lens.shape[0]
    auto = config is None
    if auto:
        config = choose_config(
            groups, D, max_query_len, R * hkv, max_seq_len, batch_invariant, element_size=q.element_size()
        )
    chunk = head_chunk(groups, D, v_head_dim, q.element_size(), config.num_splits > 1) if auto else groups
    if chunk < groups:  # one launch per KV head and run of `chunk` query heads
        out = torch.empty(T, H, v_head_dim, dtype=q.dtype, device=q.device)
        for j in range(hkv):
            for a in range(j * groups, (j + 1) * groups, chunk):
                b = min(a + chunk, (j + 1) * groups)
                out[:, a:b] = paged_attention(
                    q[:, a:b], kv_cache[:, j : j + 1], block_tables, query_start_loc, seq_lens,
                    max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale, v_head_dim=v_head_dim,
                    kv_shared=kv_shared, window=window, batch_invariant=batch_invariant,
                )  # fmt: skip
        return out
    da, block_db, db = head_split(D)
    tpt = max(1, config.block_m // groups)
    tiles = -(-max_query_len // tpt)
    block_dv = max(16, _pow2(v_head_dim))
    splits = config.num_splits
    out = torch.empty(T, H, v_head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        part = torch.empty(splits, T, H, v_head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, T, H, dtype=torch.float32, device=q.device)
    else:
        part, lse = out.unsqueeze(0), out  # lse unused
    cs = kv_cache.stride()
    _paged_attention_kernel[(R * tiles, hkv, splits)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, part, lse,
        q.stride(0), q.stride(1),
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0) if splits > 1 else 0, lse.stride(1) if splits > 1 else 0,
        cs[0], cs[1], cs[3],
        block_tables.stride(0),
        float(scale), block_size, int(window or 0), tiles, splits,
        G=groups, TPT=tpt, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        DA=da, DA_OK=min(da, D), BLOCK_DB=block_db, DB=db, BLOCK_DV=block_dv, DV=v_head_dim,
        V_PLANE=0 if kv_shared or planes == 1 else 1,
        HAS_WINDOW=window is not None, SPLIT=splits > 1, IEEE=q.dtype == torch.float32 or interpreting(),
        UPCAST=interpreting() and q.dtype != torch.float32,
        **launch_kw(q), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        merge_splits(part, lse, out)
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_cp,
    s_ch,
    s_cs,
    D: tl.constexpr,
    DV: tl.constexpr,
    HAS_V: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Token t, KV head h: K (and V, into the second plane) stored at the token's slot, cast to
    the cache dtype; one launch for both planes where the reference scatters each separately."""
    gdc_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    dst = cache_ptr + h * s_ch + slot * s_cs
    k = tl.load(k_ptr + t * s_kt + h * s_kh + offs, mask=offs < D)
    tl.store(dst + offs, k.to(cache_ptr.dtype.element_ty), mask=offs < D)
    if HAS_V:
        v = tl.load(v_ptr + t * s_vt + h * s_vh + offs, mask=offs < DV)
        tl.store(dst + s_cp + offs, v.to(cache_ptr.dtype.element_ty), mask=offs < DV)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_dim: int,
    v_head_dim: int,
) -> None:
    """``k [T, Hkv, head_dim]`` (and ``v [T, Hkv, v_head_dim]`` unless the layer shares K and V)
    into ``kv_cache [planes, Hkv, blocks, block_size, W]`` at ``slot_mapping [T]``, as
    ``deepinfer_core.attention.torch_ref.write_kv`` does, in one launch."""
    T, hkv = k.shape[0], k.shape[1]
    if not T:
        return
    if k.stride(-1) != 1 or (v is not None and v.stride(-1) != 1) or kv_cache.stride(-1) != 1:
        k = k.contiguous()
        v = v.contiguous() if v is not None else None
    cs = kv_cache.stride()
    _write_kv_kernel[(T, hkv)](
        k, v if v is not None else k, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), (v if v is not None else k).stride(0), (v if v is not None else k).stride(1),
        cs[0], cs[1], cs[3],
        D=head_dim, DV=v_head_dim, HAS_V=v is not None, BLOCK=_pow2(max(head_dim, v_head_dim if v is not None else 1)),
        **launch_kw(k), num_warps=1 if max(head_dim, v_head_dim) <= 256 else 4,
    )  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_ps,
    stride_ls,
    DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One (token, head) row per program: the split weights ``softmax_s(lse_s)`` (empty splits
    carry -inf and weigh 0) and the weighted sum of the partial outputs, in float32, rounded
    once to the output dtype. Rows are contiguous: ``part [S, rows, DV]``, ``lse [S, rows]``,
    ``out [rows, DV]``."""
    gdc_enter(PDL)
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    lse = tl.load(lse_ptr + s * stride_ls + row, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)
    total = tl.maximum(tl.sum(w, 0), 1e-30)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = dv < DV
    p = tl.load(
        part_ptr + s[:, None] * stride_ps + row.to(tl.int64) * DV + dv[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    o = tl.sum(p * w[:, None], 0) / total
    tl.store(out_ptr + row.to(tl.int64) * DV + dv, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Combine split-KV partials into ``out``: one Triton launch per layer (the torch ops it
    replaces were ~11 kernels a layer, 0.2-0.3 ms of a V3-mini decode step; benchmarks/README.md)."""
    S, T, H, DV = part.shape
    if not (part.is_contiguous() and lse.is_contiguous() and out.is_contiguous()):
        merge_splits_reference(part, lse, out)
        return
    _merge_splits_kernel[(T * H,)](
        part, lse, out, S, part.stride(0), lse.stride(0),
        DV=DV, BLOCK_S=max(2, _pow2(S)), BLOCK_DV=max(16, _pow2(DV)), **launch_kw(part), num_warps=4,
    )  # fmt: skip


def merge_splits_reference(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Combine split-KV partials: ``out = sum_s w_s o_s`` with ``w = softmax_s(lse_s)``."""
    top = lse.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse - top)  # [S, T, H]; empty splits give 0
    total = w.sum(dim=0).clamp_min(1e-30)
    out.copy_(((part * w[..., None]).sum(dim=0) / total[..., None]).to(out.dtype))

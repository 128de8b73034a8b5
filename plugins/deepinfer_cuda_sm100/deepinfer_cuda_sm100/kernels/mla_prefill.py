"""MLA prefill in the non-absorbed form: a varlen causal flash-attention kernel with per-head
keys ``[k_nope ; k_pe]`` (k_pe shared by the heads) and values of their own width.

Why: the absorbed form (``paged_attention`` on the 576-wide latent) does 1,088 multiply-adds per
(query, key) pair and head and its wide heads leave 32-row tiles (~69 TFLOP/s on an H200,
benchmarks/README.md). Decompressing each context token's latent once through ``kv_b_proj``
turns prefill into plain causal MHA: 192-wide queries and keys, 128-wide values, 128-row tiles,
320 multiply-adds per pair. Decode keeps the absorbed form (one query per request would have to
decompress its whole context).

Layout (one batch, ``R`` requests; ``K`` context tokens in all, request ``r``'s keys at rows
``k_start[r] .. k_start[r] + seq_len[r]``, its ``qlen`` queries the last ``qlen`` positions)::

    q       [T, H, DN + DR]   per head: nope part, then the roped part
    k_nope  [K, H, DN]        kv_b_proj(latent)[..., :DN] (a strided view is fine)
    k_pe    [K, DR]           the roped key part, one per token (shared by all heads)
    v       [K, H, DV]        kv_b_proj(latent)[..., DN:]

One program computes ``BLOCK_M`` query rows of one request and one head; keys left of the
tile's first query are visited without a mask, the diagonal band with the causal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .paged_attention import _pow2, interpreting


@triton.jit
def _key_tile(
    qn,
    qr,
    kn_base,
    kr_ptr,
    v_base,
    k_start,
    start,
    hi,
    qpos,
    m_i,
    l_i,
    acc,
    s_knt,
    s_krt,
    s_vt,
    scale_log2,
    dn,
    dr,
    dv,
    DN: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One ``BLOCK_N`` run of keys folded into the online softmax (base-2 exponent)."""
    kpos = start + tl.arange(0, BLOCK_N)
    k_ok = kpos < hi
    krow = k_start + kpos.to(tl.int64)
    kn = tl.load(kn_base + krow[:, None] * s_knt + dn[None, :], mask=k_ok[:, None] & (dn < DN)[None, :], other=0.0).to(
        qn.dtype
    )
    kr = tl.load(kr_ptr + krow[:, None] * s_krt + dr[None, :], mask=k_ok[:, None] & (dr < DR)[None, :], other=0.0).to(
        qn.dtype
    )
    if IEEE:
        s = tl.dot(qn, tl.trans(kn), input_precision="ieee")
        s += tl.dot(qr, tl.trans(kr), input_precision="ieee")
    else:
        s = tl.dot(qn, tl.trans(kn))
        s += tl.dot(qr, tl.trans(kr))
    s = s * scale_log2
    if CAUSAL:
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    vv = tl.load(v_base + krow[:, None] * s_vt + dv[None, :], mask=k_ok[:, None] & (dv < DV)[None, :], other=0.0).to(
        qn.dtype
    )
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(qn.dtype), vv, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(qn.dtype), vv)
    return m_new, l_i, acc


@triton.jit
def _mla_prefill_kernel(
    q_ptr,
    kn_ptr,
    kr_ptr,
    v_ptr,
    out_ptr,
    qsl_ptr,
    ksl_ptr,
    seqlen_ptr,
    s_qt,
    s_qh,
    s_knt,
    s_knh,
    s_krt,
    s_vt,
    s_vh,
    s_ot,
    s_oh,
    scale_log2,
    tiles_per_req,
    DN: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BDN: tl.constexpr,
    BDR: tl.constexpr,
    BDV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    r = pid // tiles_per_req
    t = tiles_per_req - 1 - pid % tiles_per_req  # a request's longest (last) tiles start first
    q_start = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - q_start
    if t * BLOCK_M < qlen:
        k_start = tl.load(ksl_ptr + r).to(tl.int64)
        ctx = tl.load(seqlen_ptr + r) - qlen
        rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < qlen
        qpos = ctx + rows
        dn = tl.arange(0, BDN)
        dr = tl.arange(0, BDR)
        dv = tl.arange(0, BDV)
        q_rows = q_ptr + (q_start + rows).to(tl.int64) * s_qt + h * s_qh
        qn = tl.load(q_rows[:, None] + dn[None, :], mask=row_ok[:, None] & (dn < DN)[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter computes bf16 dots wrongly: test them in float32
            qn = qn.to(tl.float32)
        qr = tl.load(q_rows[:, None] + DN + dr[None, :], mask=row_ok[:, None] & (dr < DR)[None, :], other=0.0).to(
            qn.dtype
        )

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BDV], tl.float32)
        kn_base = kn_ptr + h * s_knh
        v_base = v_ptr + h * s_vh
        # keys before the tile's first query are visible to every row: no mask in that loop
        full_end = ((ctx + t * BLOCK_M) // BLOCK_N) * BLOCK_N
        hi = ctx + tl.minimum(qlen, (t + 1) * BLOCK_M)
        for start in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _key_tile(qn, qr, kn_base, kr_ptr, v_base, k_start, start, hi, qpos, m_i, l_i, acc, s_knt,
                                      s_krt, s_vt, scale_log2, dn, dr, dv, DN, DR, DV, BLOCK_N, False,
                                      IEEE)  # fmt: skip
        for start in range(full_end, hi, BLOCK_N):
            m_i, l_i, acc = _key_tile(qn, qr, kn_base, kr_ptr, v_base, k_start, start, hi, qpos, m_i, l_i, acc, s_knt,
                                      s_krt, s_vt, scale_log2, dn, dr, dv, DN, DR, DV, BLOCK_N, True, IEEE)  # fmt: skip

        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + (q_start + rows).to(tl.int64)[:, None] * s_ot + h * s_oh + dv[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape of one launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def choose_config(dtype: torch.dtype, head_width: int) -> PrefillConfig:
    """128 x 128 tiles, 8 warps, 2 stages for half-precision queries up to 256 wide: the fastest
    or tied of nine shapes on an H200 at V3's widths (``benchmarks/kernels/mla_prefill.py --sweep``:
    64 x 512 prompts 0.480 ms vs 0.509 for 128 x 64; 4 x 4096 0.916 vs 1.219; a 2,048 chunk over
    6,144 cached 0.504 vs 0.614). float32 (and the interpreter) in 64 x 32 tiles, which fit."""
    if interpreting():
        return PrefillConfig(32, 32, 4, 1)
    if dtype == torch.float32 or head_width > 256:
        return PrefillConfig(64, 32, 4, 2)
    return PrefillConfig(128, 128, 8, 2)


def mla_prefill_attention(
    q: torch.Tensor,  # [T, H, DN + DR]
    k_nope: torch.Tensor,  # [K, H, DN]
    k_pe: torch.Tensor,  # [K, DR]
    v: torch.Tensor,  # [K, H, DV]
    query_start_loc: torch.Tensor,  # [R+1] int32
    key_start_loc: torch.Tensor,  # [R+1] (or [R]) int32/int64: first key row of each request
    seq_lens: torch.Tensor,  # [R] int32: keys of each request (its queries are the last ones)
    *,
    max_query_len: int,
    scale: float,
    config: PrefillConfig | None = None,
) -> torch.Tensor:  # [T, H, DV] in q.dtype
    """Causal attention of each request's queries over its ``seq_len`` keys (one launch)."""
    T, H, DQ = q.shape
    DN = k_nope.shape[-1]
    DR, DV = DQ - DN, v.shape[-1]
    if k_pe.shape[-1] != DR:
        raise ValueError(
            f"mla_prefill_attention: q is {DQ} wide and k_nope {DN}, so k_pe must be {DR} wide, got {k_pe.shape[-1]}"
        )
    if any(x.stride(-1) != 1 for x in (q, k_nope, k_pe, v)):
        raise ValueError("mla_prefill_attention: q, k_nope, k_pe and v need a contiguous last dimension")
    out = torch.empty(T, H, DV, dtype=q.dtype, device=q.device)
    R = seq_lens.shape[0]
    if not T or not R:
        return out
    cfg = config or choose_config(q.dtype, DQ)
    tiles = -(-max_query_len // cfg.block_m)
    _mla_prefill_kernel[(R * tiles, H)](
        q, k_nope, k_pe, v, out, query_start_loc, key_start_loc, seq_lens,
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        float(scale) * math.log2(math.e), tiles,
        DN=DN, DR=DR, DV=DV, BDN=max(16, _pow2(DN)), BDR=max(16, _pow2(DR)), BDV=max(16, _pow2(DV)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, IEEE=q.dtype == torch.float32 or interpreting(),
        UPCAST=interpreting() and q.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out

"""DeepSeek-V4 compressor decode step in one launch (``V4AttentionBackend.compress_decode``).

In a decode batch each compressor (CSA: the compressor and the indexer's; HCA: one) stores the
new token's raw projections in the request's state tail and, where the token closes a window,
pools the window into a compressed entry: softmax over the window's rows of ``gate +
position_bias`` weighting ``kv`` (CSA: the previous window's first half too), RMS norm, rope at
the window's first position, written to block KV. The core's fixed-shape torch form
(``deepseek_v4_decode.decode_update_entries``) is ~45 kernels per compressor; here one program
per request does the tail write and, only where a window closes, the pooling with an online
softmax over the rows (float32), the norm and the rope, and the entry write. Rounding follows
the torch form: pooled value, normed value and roped value each rounded to the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_elementwise import _round
from .paged_attention import _pow2, interpreting


@triton.jit
def _compress_decode_kernel(
    new_ptr, tail_ptr, slot_ptr, pos_ptr, pb_ptr, normw_ptr, cos_ptr, sin_ptr, ent_ptr, bt_ptr,
    stride_new, stride_ts, stride_tr, tail_col, tail_rows, stride_eb, stride_ee, entry_col, stride_bt, stride_cos,
    per_block, eps,
    RATIO: tl.constexpr, W: tl.constexpr, DH: tl.constexpr, ROPE2: tl.constexpr, OVERLAP: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    q = tl.program_id(0).to(tl.int64)
    s = tl.load(pos_ptr + q).to(tl.int64)
    slot = tl.load(slot_ptr + q).to(tl.int64)
    new_row = new_ptr + q * stride_new
    tail_row = tail_ptr + slot * stride_ts + tail_col
    dtype = new_ptr.dtype.element_ty
    i = tl.arange(0, DH)
    # the new row's kv | gate into the ring (a row no one reads in this step)
    for c0 in range(0, 2 * W, 2 * DH):
        c = c0 + 2 * i
        here = tail_row + (s % tail_rows) * stride_tr
        tl.store(here + c, tl.load(new_row + c).to(tail_ptr.dtype.element_ty))
        tl.store(here + c + 1, tl.load(new_row + c + 1).to(tail_ptr.dtype.element_ty))
    if (s + 1) % RATIO == 0:
        SPAN: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
        w = s // RATIO
        m_e = tl.full((DH,), -1e30, tl.float32)
        m_o = tl.full((DH,), -1e30, tl.float32)
        l_e = tl.zeros((DH,), tl.float32)
        l_o = tl.zeros((DH,), tl.float32)
        a_e = tl.zeros((DH,), tl.float32)
        a_o = tl.zeros((DH,), tl.float32)
        for j0 in range(0, SPAN, BLOCK_R):
            jj = j0 + tl.arange(0, BLOCK_R)
            in_span = jj < SPAN
            p = s - SPAN + 1 + jj
            if OVERLAP:
                prev = jj < RATIO
                col = tl.where(prev, 0, 2 * DH)  # previous window: first half of the columns, current: second
                pb_row = tl.where(prev, jj, jj - RATIO)
                ok = in_span & (
                    (jj >= RATIO) | ((jj * 0 + w) >= 1)
                )  # a tensor compare: the interpreter makes a scalar bool mix int32
            else:
                col = tl.zeros((BLOCK_R,), tl.int32)
                pb_row = jj
                ok = in_span
            ring = tl.where(p >= 0, p, p + tail_rows) % tail_rows
            old = tail_row + ring[:, None] * stride_tr + col[:, None]
            fresh = new_row + col[:, None]
            ce = 2 * i[None, :]
            take_old = (ok & (p != s))[:, None] & (ce >= 0)
            take_new = (ok & (p == s))[:, None] & (ce >= 0)
            kv_e = tl.load(old + ce, mask=take_old, other=0.0).to(tl.float32) + tl.load(
                fresh + ce, mask=take_new, other=0.0
            ).to(tl.float32)
            kv_o = tl.load(old + ce + 1, mask=take_old, other=0.0).to(tl.float32) + tl.load(
                fresh + ce + 1, mask=take_new, other=0.0
            ).to(tl.float32)
            g_e = tl.load(old + W + ce, mask=take_old, other=0.0).to(tl.float32) + tl.load(
                fresh + W + ce, mask=take_new, other=0.0
            ).to(tl.float32)
            g_o = tl.load(old + W + ce + 1, mask=take_old, other=0.0).to(tl.float32) + tl.load(
                fresh + W + ce + 1, mask=take_new, other=0.0
            ).to(tl.float32)
            pb = pb_ptr + pb_row[:, None] * W + col[:, None] + ce
            g_e = tl.where(
                ok[:, None], _round(g_e, dtype) + tl.load(pb, mask=ok[:, None] & (ce >= 0), other=0.0), float("-inf")
            )
            g_o = tl.where(
                ok[:, None],
                _round(g_o, dtype) + tl.load(pb + 1, mask=ok[:, None] & (ce >= 0), other=0.0),
                float("-inf"),
            )
            n_e = tl.maximum(m_e, tl.max(g_e, axis=0))
            n_o = tl.maximum(m_o, tl.max(g_o, axis=0))
            p_e = tl.exp(g_e - n_e[None, :])
            p_o = tl.exp(g_o - n_o[None, :])
            f_e = tl.exp(m_e - n_e)
            f_o = tl.exp(m_o - n_o)
            l_e = l_e * f_e + tl.sum(p_e, axis=0)
            l_o = l_o * f_o + tl.sum(p_o, axis=0)
            a_e = a_e * f_e + tl.sum(p_e * kv_e, axis=0)
            a_o = a_o * f_o + tl.sum(p_o * kv_o, axis=0)
            m_e, m_o = n_e, n_o
        x_e = _round(a_e / l_e, dtype)
        x_o = _round(a_o / l_o, dtype)
        rms = 1.0 / tl.sqrt((tl.sum(x_e * x_e, axis=0) + tl.sum(x_o * x_o, axis=0)) / (2 * DH) + eps)
        x_e = _round(tl.load(normw_ptr + 2 * i).to(tl.float32) * (x_e * rms), dtype)
        x_o = _round(tl.load(normw_ptr + 2 * i + 1).to(tl.float32) * (x_o * rms), dtype)
        k = i - (DH - ROPE2)
        roped = k >= 0
        cos = tl.load(cos_ptr + q * stride_cos + k, mask=roped, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + q * stride_cos + k, mask=roped, other=0.0).to(tl.float32)
        y_e = tl.where(roped, _round(x_e * cos - x_o * sin, dtype), x_e)
        y_o = tl.where(roped, _round(x_o * cos + x_e * sin, dtype), x_o)
        block = tl.load(bt_ptr + q * stride_bt + w // per_block).to(tl.int64)
        dst = ent_ptr + block * stride_eb + (w % per_block) * stride_ee + entry_col
        tl.store(dst + 2 * i, y_e.to(ent_ptr.dtype.element_ty))
        tl.store(dst + 2 * i + 1, y_o.to(ent_ptr.dtype.element_ty))


def compress_decode(
    new: torch.Tensor,  # [R, 2 * width] this step's kv | gate projections
    tail: torch.Tensor,  # [slots, rows, tail_width] state tails
    tail_col: int,
    slots: torch.Tensor,  # [R]
    positions: torch.Tensor,  # [R]
    position_bias: torch.Tensor,  # [ratio, width] float32
    norm_weight: torch.Tensor,  # [dim] float32
    eps: float,
    cos: torch.Tensor,  # [R, rope / 2] rope at each request's window start, in new's dtype
    sin: torch.Tensor,
    entries: torch.Tensor,  # [blocks, per_block, entry_width]
    entry_col: int,
    block_tables: torch.Tensor,  # [R, max_blocks]
    *,
    ratio: int,
    block_size: int,
    overlap: bool,
) -> None:
    R, two_w = new.shape
    width = two_w // 2
    dim = width // 2 if overlap else width
    if dim % 2 or dim & (dim - 1) or tail.stride(-1) != 1 or entries.stride(-1) != 1:
        raise ValueError(
            "compress_decode: the compressed width must be an even power of two and the caches contiguous rows "
            f"(dim {dim})"
        )
    new, position_bias, norm_weight = new.contiguous(), position_bias.contiguous(), norm_weight.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    span = 2 * ratio if overlap else ratio
    if R:
        _compress_decode_kernel[(R,)](
            new, tail, slots, positions, position_bias, norm_weight, cos, sin, entries, block_tables,
            new.stride(0), tail.stride(0), tail.stride(1), int(tail_col), tail.shape[1], entries.stride(0),
            entries.stride(1), int(entry_col), block_tables.stride(0), cos.stride(0), block_size // ratio, float(eps),
            RATIO=ratio, W=width, DH=dim // 2, ROPE2=cos.shape[-1], OVERLAP=overlap,
            BLOCK_R=min(16 if interpreting() else 8, _pow2(span)), num_warps=4,
        )  # fmt: skip

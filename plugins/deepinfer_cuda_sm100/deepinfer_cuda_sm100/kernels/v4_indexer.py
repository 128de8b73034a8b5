"""DeepSeek-V4's lightning-indexer scores in Triton: for every token ``t`` and compressed entry
``w`` of its request, in one launch for the whole batch,

    score[t, w] = sum_h weights[t, h] * relu(q[t, h] . key[w]) * scale     (-inf where w >= (p_t + 1) // ratio)

with ``key[w]`` read through the block table from the CSA entries' indexer columns. The torch
path computes ``[t, heads, n]`` float32 products per request (prefill at 4K tokens over 1K
entries, 64 heads: a gigabyte) and ~10 launches per request per layer; here a program keeps one
token's heads in registers, scores a tile of entries and writes only ``[T, n]``. The top-k that
follows stays the core's (its tie-breaking is part of the model's contract).

Float32 inputs use IEEE dots (the reference's float32 matmul); bf16 inputs multiply exactly into
float32 accumulators, as the reference's ``.float()`` products do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _pow2, interpreting


@triton.jit
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    ent_ptr,
    bt_ptr,
    qsl_ptr,
    pos_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_eb,
    stride_ee,
    stride_bt,
    stride_ot,
    key_col,
    heads,
    ratio,
    per_block,
    n_max,
    scale,
    num_requests,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0)
    tile = tl.program_id(1)
    req = tl.arange(0, BLOCK_R)
    ends = tl.load(qsl_ptr + 1 + req, mask=req < num_requests, other=2147483647)
    r = tl.sum((ends <= t).to(tl.int32), 0)  # the token's request: how many requests end at or before it
    visible = (tl.load(pos_ptr + t) + 1) // ratio
    w = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if tile * BLOCK_N >= visible:  # a tile past the token's entries (CUDA graphs score every slot the table addresses)
        tl.store(
            out_ptr + t.to(tl.int64) * stride_ot + w, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=w < n_max
        )
        return
    h = tl.arange(0, BLOCK_H)
    h_ok = h < heads
    d = tl.arange(0, DI)
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None], other=0.0)
    wts = tl.load(w_ptr + t.to(tl.int64) * stride_wt + h, mask=h_ok, other=0.0).to(tl.float32)
    ok = w < visible
    page = tl.load(bt_ptr + r * stride_bt + w // per_block, mask=ok, other=0).to(tl.int64)
    k = tl.load(
        ent_ptr + page[:, None] * stride_eb + (w % per_block)[:, None] * stride_ee + key_col + d[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = tl.maximum(s, 0.0) * scale
    score = tl.sum(s * wts[:, None], 0)
    score = tl.where(ok, score, float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + w, score, mask=w < n_max)


def index_scores(
    q: torch.Tensor,  # [T, heads, DI] roped indexer queries
    weights: torch.Tensor,  # [T, heads] float32 head weights (already scaled)
    entries: torch.Tensor,  # [blocks, per_block, width]; the keys are columns key_col..key_col+DI
    key_col: int,
    positions: torch.Tensor,  # [T]
    query_start_loc: torch.Tensor,  # [R+1] int32 (on the device: no host copy)
    block_tables: torch.Tensor,  # [R, max_blocks]
    *,
    ratio: int,
    block_size: int,
    n_max: int,
    scale: float,
) -> torch.Tensor:  # [T, n_max] float32
    T, heads, DI = q.shape
    if DI < 16 or DI & (DI - 1):
        raise ValueError(f"index_scores: index_head_dim must be a power of two >= 16, got {DI}")
    out = torch.empty(T, n_max, dtype=torch.float32, device=q.device)
    if T == 0 or n_max == 0:
        return out
    q = q.contiguous()
    block_n = 16 if interpreting() else 64
    ieee = q.dtype == torch.float32 or interpreting()
    _index_scores_kernel[(T, -(-n_max // block_n))](
        q, weights, entries, block_tables, query_start_loc, positions, out,
        q.stride(0), q.stride(1), weights.stride(0), entries.stride(0), entries.stride(1), block_tables.stride(0),
        out.stride(0), int(key_col), heads, int(ratio), block_size // ratio, n_max, float(scale), block_tables.shape[0],
        BLOCK_H=max(16, _pow2(heads)), BLOCK_N=block_n, DI=DI, BLOCK_R=max(16, _pow2(block_tables.shape[0])), IEEE=ieee,
        num_warps=4,
    )  # fmt: skip
    return out

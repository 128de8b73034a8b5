"""DeepSeek-V4 attention in Triton: sliding window, heavily compressed (HCA) and compressed
sparse (CSA) layers, prefill, chunked prefill and decode, in one kernel over the engine's V4
cache (``deepinfer_core.models.deepseek_v4.kv.V4LayerCache``).

Per query position ``p`` of request ``r`` the keys (K = V, one head shared by all query heads) are

    window   positions ``p - W < pos <= p``: older ones from the request's state ring
             (``cache.window[slot, pos % rows]``), this step's from ``kv``
    entries  HCA: every ``w < (p + 1) // ratio``; CSA: the ids in ``selected[t]`` (-1: none),
             read through the block table from ``cache.entries[block, w % per_block, :D]``

and the softmax has one extra sink logit per head that takes mass and adds nothing.

One program owns a tile of ``BLOCK_M`` rows of one request: row ``i`` is token ``i // H`` of the
tile and head ``i % H``, so every key load serves all heads (the MQA form; V4 has 64 heads, its
mini 16). CSA tiles hold one token, because each token has its own entry list; sliding and HCA
tiles hold ``BLOCK_M // H`` tokens. The key space of a tile is the window tiles followed by the
entry tiles, both in ``BLOCK_N`` steps; split-KV cuts that space into equal runs of whole tiles
(decode with few requests), the sink is counted by split 0 only, and the partials are merged by
``paged_attention.merge_splits``. The split count depends on shapes only, and batch-invariant
callers get one split, so a request's arithmetic never depends on its batch.

The ring write happens after the attention, in its own small kernel: a new key at ``p``
overwrites the ring row of ``p - rows``, which queries of the same step still read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import LaunchConfig, _pow2, interpreting, merge_splits


@triton.jit
def _v4_attention_kernel(
    q_ptr,
    kv_ptr,
    ring_ptr,
    ent_ptr,
    sel_ptr,
    sink_ptr,
    bt_ptr,
    qsl_ptr,
    seqlen_ptr,
    slot_ptr,
    out_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_rs,
    stride_rr,
    stride_eb,
    stride_ee,
    stride_st,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    scale,
    window,
    ring_rows,
    ratio,
    per_block,
    num_sel,
    tiles_per_req,
    num_splits,
    H: tl.constexpr,
    TPT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    MODE: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # MODE: 0 sliding, 1 heavily compressed (every visible entry), 2 compressed sparse (selected)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    r = pid // tiles_per_req
    t = pid % tiles_per_req
    q_start = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - q_start
    if t * TPT < qlen:
        ctx = tl.load(seqlen_ptr + r) - qlen  # first new position
        slot = tl.load(slot_ptr + r).to(tl.int64)
        rows = tl.arange(0, BLOCK_M)
        tok = t * TPT + rows // H
        head = rows % H
        row_ok = (rows < TPT * H) & (tok < qlen)
        qpos = ctx + tok
        d = tl.arange(0, D)
        q_rows = q_ptr + (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        qt = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:  # Triton's interpreter computes bf16 dots wrongly: test them in float32
            qt = qt.to(tl.float32)

        last = tl.minimum(qlen, (t + 1) * TPT) - 1
        w_lo = tl.maximum(0, ctx + t * TPT - window + 1)
        w_hi = ctx + last + 1
        win_tiles = (w_hi - w_lo + BLOCK_N - 1) // BLOCK_N
        n_ent = w_hi * 0  # sliding: no entries
        if MODE == 1:
            n_ent = w_hi // ratio
        if MODE == 2:
            n_ent = n_ent + num_sel
        n_tiles = win_tiles + (n_ent + BLOCK_N - 1) // BLOCK_N
        per_split = (n_tiles + num_splits - 1) // num_splits
        i_lo = split * per_split
        i_hi = tl.minimum(n_tiles, i_lo + per_split)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        visible = (qpos + 1) // ratio  # HCA entries each row sees (the host passes ratio >= 1)
        for i in range(i_lo, i_hi):
            if i < win_tiles:
                kpos = w_lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
                k_ok = kpos < w_hi
                old = k_ok & (kpos < ctx)
                new = k_ok & (kpos >= ctx)
                ring_rows_ptr = ring_ptr + slot * stride_rs + (kpos % ring_rows).to(tl.int64) * stride_rr
                new_rows_ptr = kv_ptr + (q_start + kpos - ctx).to(tl.int64) * stride_kvt
                k = tl.load(ring_rows_ptr[:, None] + d[None, :], mask=old[:, None], other=0.0).to(qt.dtype)
                k += tl.load(new_rows_ptr[:, None] + d[None, :], mask=new[:, None], other=0.0).to(qt.dtype)
                allowed = k_ok[None, :] & (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
            else:
                j = (i - win_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
                j_ok = j < n_ent
                if MODE == 2:
                    w = tl.load(sel_ptr + (q_start + t).to(tl.int64) * stride_st + j, mask=j_ok, other=-1)
                    e_ok = j_ok & (w >= 0)
                    allowed = e_ok[None, :] & row_ok[:, None]
                else:
                    w = j
                    e_ok = j_ok
                    allowed = e_ok[None, :] & (w[None, :] < visible[:, None])
                w = tl.where(e_ok, w, 0)
                page = tl.load(bt_ptr + r * stride_bt + w // per_block, mask=e_ok, other=0).to(tl.int64)
                e_rows = ent_ptr + page * stride_eb + (w % per_block) * stride_ee
                k = tl.load(e_rows[:, None] + d[None, :], mask=e_ok[:, None], other=0.0).to(qt.dtype)
            if IEEE:
                s = tl.dot(qt, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(qt, tl.trans(k))
            s = tl.where(allowed, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(qt.dtype), k, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(qt.dtype), k)
            m_i = m_new
        if split == 0:  # the sink: one more logit per head, no value
            sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.exp(sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_ptrs = (
            out_ptr
            + split * stride_os
            + (q_start + tok).to(tl.int64)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + d[None, :]
        )
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if SPLIT:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
            tl.store(lse_ptr + split * stride_ls + (q_start + tok) * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _ring_write_kernel(
    kv_ptr,
    ring_ptr,
    qsl_ptr,
    seqlen_ptr,
    slot_ptr,
    stride_kvt,
    stride_rs,
    stride_rr,
    ring_rows,
    D: tl.constexpr,
):
    """Request ``r``'s new keys whose position is among its last ``ring_rows`` go to the ring."""
    r = tl.program_id(0)
    q_start = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - q_start
    e = tl.load(seqlen_ptr + r)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    d = tl.arange(0, D)
    first = tl.maximum(0, qlen - ring_rows)
    for i in range(first, qlen):
        pos = e - qlen + i
        row = tl.load(kv_ptr + (q_start + i).to(tl.int64) * stride_kvt + d)
        tl.store(ring_ptr + slot * stride_rs + (pos % ring_rows) * stride_rr + d, row.to(ring_ptr.dtype.element_ty))


MODES = {"sliding": 0, "heavily_compressed": 1, "compressed_sparse": 2}


def supported_head_dim(head_dim: int) -> bool:
    """The kernel keeps a whole head in one power-of-two tile (V4: 512)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def choose_v4_config(num_heads: int, head_dim: int, max_query_len: int, sparse: bool, num_requests: int, max_keys: int,
                     batch_invariant: bool, sms: int = 132) -> LaunchConfig:  # fmt: skip
    """Tile shape and split count from shapes only (never from data). ``max_keys`` bounds the keys
    of one token (window + visible or selected entries). Decode splits only past 1024 keys per
    token: below that one program's loop is shorter than the merge's extra launches."""
    wide = head_dim > 256
    block_n = 16 if interpreting() else (32 if wide else 64)
    warps, stages = (8, 2) if wide else (4, 2)
    heads = max(16, _pow2(num_heads))
    if sparse or (max_query_len == 1 and not batch_invariant):
        block_m = heads  # one token per tile (batch-invariant steps keep one tile shape throughout)
    else:
        block_m = max(heads, 32 if wide else 64)
    splits = 1
    if max_query_len == 1 and not batch_invariant and num_requests < sms:
        splits = max(1, min(8, -(-2 * sms // max(num_requests, 1)), max_keys // 1024))
    return LaunchConfig(block_m, block_n, splits, warps, stages)


def v4_attention(
    kind: str,  # "sliding" | "heavily_compressed" | "compressed_sparse"
    q: torch.Tensor,  # [T, H, D] roped queries
    kv: torch.Tensor,  # [T, D] this step's keys (= values)
    sinks: torch.Tensor,  # [H]
    ring: torch.Tensor,  # [slots, rows, D] state ring
    entries: torch.Tensor | None,  # [blocks, per_block, width] compressed entries (first D columns)
    selected: torch.Tensor | None,  # [T, k] entry ids, -1 none (compressed_sparse)
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    window: int,
    ratio: int,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    batch_invariant: bool = False,
    write_ring: bool = True,
    config: LaunchConfig | None = None,
) -> torch.Tensor:  # [T, H, D] in q.dtype
    """Attention of each request's new tokens (see the module docstring), then the ring write."""
    T, H, D = q.shape
    mode = MODES[kind]
    if not supported_head_dim(D):
        raise ValueError(f"v4_attention: head_dim must be a power of two >= 16, got {D}")
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or ring.stride(-1) != 1:
        raise ValueError("v4_attention: q, kv and the ring need a contiguous last dimension")
    R = seq_lens.shape[0]
    if config is None:
        entries_max = (selected.shape[1] if mode == 2 else max_seq_len // ratio) if mode else 0
        config = choose_v4_config(H, D, max_query_len, mode == 2, R, window + entries_max, batch_invariant)
    tpt = 1 if mode == 2 else max(1, config.block_m // H)
    tiles = -(-max_query_len // tpt)
    splits = config.num_splits
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if splits > 1:
        part = torch.empty(splits, T, H, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, T, H, dtype=torch.float32, device=q.device)
    else:
        part, lse = out.unsqueeze(0), out  # lse unused
    ents = entries if mode else ring  # any tensor: never read for sliding layers
    sel = selected if mode == 2 else block_tables
    per_block = block_size // ratio if mode else 1
    if T:
        _v4_attention_kernel[(R * tiles, splits)](
            q, kv, ring, ents, sel, sinks, block_tables, query_start_loc, seq_lens, state_slots, part, lse,
            q.stride(0), q.stride(1), kv.stride(0),
            ring.stride(0), ring.stride(1), ents.stride(0), ents.stride(1), sel.stride(0), block_tables.stride(0),
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0) if splits > 1 else 0, lse.stride(1) if splits > 1 else 0,
            float(scale), int(window), ring.shape[1], int(ratio or 1), per_block, sel.shape[1] if mode == 2 else 0,
            tiles, splits, H=H, TPT=tpt, BLOCK_M=config.block_m, BLOCK_N=config.block_n, D=D,
            MODE=mode, SPLIT=splits > 1, IEEE=q.dtype == torch.float32 or interpreting(),
            UPCAST=interpreting() and q.dtype != torch.float32,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        if splits > 1:
            merge_splits(part, lse, out)
        if write_ring:
            write_ring_rows(kv, ring, query_start_loc, seq_lens, state_slots)
    return out


def write_ring_rows(kv, ring, query_start_loc, seq_lens, state_slots) -> None:
    """Store each request's new keys in its ring (the last ``rows`` positions only)."""
    R = seq_lens.shape[0]
    _ring_write_kernel[(R,)](
        kv, ring, query_start_loc, seq_lens, state_slots, kv.stride(0), ring.stride(0), ring.stride(1), ring.shape[1],
        D=kv.shape[-1], num_warps=4,
    )  # fmt: skip

"""DeepSeek-V4's general step (prefill, chunked prefill, replays) for every request at once:
the compressors' closing windows and the indexer's top-k as a few tensor ops over the flat batch.

Why: looping over requests (and, for the indexer, over positions) in Python issued ~25 small
torch ops per request, compressor and layer; at 64 x 512 prompt tokens on an H200 that host work
(0.49 s per step) bounded V4 prefill, not the kernels. Here the batch layout, which the host
knows (token ranges, starts, state slots, prompt lengths), is turned by numpy into index arrays,
packed into one int64 buffer and copied to the device once per step and layer kind (cached on the
:class:`~.batch.V4Batch`, shared by the layers of that kind). The device then
runs one gather, the pooling of every closing window as one batch and one indexed write each.

Source rows of request ``r`` (new positions ``s_r .. e_r - 1``, its state tail holding the
positions before ``s_r`` by ``position % rows``)::

    cat([old: tail[slot_r, p % rows] for p in lo_r .. s_r - 1, for each request r]   # M rows
        [new: the flat batch's projections])                                          # T rows
    entry w pools positions [w * ratio - back, (w + 1) * ratio)    back = ratio (CSA overlap) or 0

The arithmetic per entry and per ranked row is the per-request code's, so the results are the
same whatever the batch: ``tests/test_deepseek_v4_prefill.py`` checks a mixed batch against each
request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...staging import arrays_to_device
from .batch import V4Batch


def _upload(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """One host-to-device copy for several int64 index arrays (views of one buffer)."""
    sizes = [len(a) for a in arrays]
    buf = arrays_to_device(arrays, torch.device(device))
    return list(buf.split(sizes))


def _layout(batch: V4Batch):
    """Per request (a, n, s, e, slot) and per flat row (request, index in request, position, row)."""
    a = np.array([r[0] for r in batch.token_ranges], dtype=np.int64)
    n = np.array([r[1] - r[0] for r in batch.token_ranges], dtype=np.int64)
    s = np.array(batch.starts, dtype=np.int64)
    req_t = np.repeat(np.arange(len(a)), n)
    i = np.arange(len(req_t)) - (np.cumsum(n) - n)[req_t]
    return a, n, s, s + n, req_t, i, s[req_t] + i, a[req_t] + i


@dataclass(frozen=True)
class WindowPlan:
    """Where every window closing in this step reads its rows and writes its entry, and which new
    rows refresh the state tails (all index tensors on the device)."""

    entries: int  # N windows closing in this step (host)
    source: torch.Tensor  # [N, span] rows of cat(old, new) each window pools (0 before position 0: masked)
    positions: torch.Tensor  # [N] each entry's rope position (its window's first position)
    blocks: torch.Tensor  # [N] block id of each entry
    offsets: torch.Tensor  # [N] entry slot in that block
    old_slots: torch.Tensor  # [M] state slot of each old tail row read
    old_rows: torch.Tensor  # [M] its ring row
    keep: torch.Tensor  # [K] flat rows whose projections go into the tails
    keep_slots: torch.Tensor  # [K]
    keep_rows: torch.Tensor  # [K] ring rows


def window_plan(batch: V4Batch, ratio: int, overlap: bool, tail_rows: int, replay: bool, device) -> WindowPlan:
    """The :class:`WindowPlan` of ``batch`` for compressors of ``ratio`` (a replay closes no
    window: its entries are already in the shared cached blocks)."""
    a, n, s, e, req_t, _, p, rows = _layout(batch)
    slot = np.array(batch.slots, dtype=np.int64)
    R, back = len(a), ratio if overlap else 0
    w0 = s // ratio
    c = np.zeros(R, dtype=np.int64) if replay else e // ratio - w0  # windows closing per request
    lo = np.maximum(0, w0 * ratio - back)  # first position a closing window reads; the tail holds it (rows >= s - lo)
    m = np.where(c > 0, s - lo, 0)
    m_start = np.cumsum(m) - m
    req_old = np.repeat(np.arange(R), m)
    old_pos = lo[req_old] + np.arange(len(req_old)) - m_start[req_old]
    req_e = np.repeat(np.arange(R), c)
    win = w0[req_e] + np.arange(len(req_e)) - (np.cumsum(c) - c)[req_e]
    pos = (win * ratio - back)[:, None] + np.arange(ratio + back)[None, :]  # [N, span]
    rs = s[req_e][:, None]
    source = np.where(
        pos >= rs, len(req_old) + a[req_e][:, None] + pos - rs, m_start[req_e][:, None] + pos - lo[req_e][:, None]
    )
    source = np.where(pos >= 0, source, 0)
    keep = p >= e[req_t] - tail_rows  # the last tail_rows positions of each request
    per_block = batch.block_size // ratio
    parts = _upload(
        [source.reshape(-1), win * ratio, req_e, win // per_block, win % per_block, slot[req_old], old_pos % tail_rows,
         rows[keep], slot[req_t][keep], p[keep] % tail_rows], device,
    )  # fmt: skip
    src, positions, req_dev, col, offsets, old_slots, old_rows, keep_rows, keep_slots, keep_ring = parts
    table = batch.block_tables
    blocks = table[req_dev, col.clamp(max=table.shape[1] - 1)].long()
    return WindowPlan(
        len(req_e),
        src.view(len(req_e), ratio + back),
        positions,
        blocks,
        offsets,
        old_slots,
        old_rows,
        keep_rows,
        keep_slots,
        keep_ring,
    )


def update_entries_batched(compressors, raw: list[torch.Tensor], cache, plan: WindowPlan, rope) -> None:
    """Every closing window's entry for every request and compressor of one layer, then every
    tail refreshed: one gather, one pooling per compressor, one write each. ``compressors``
    [(compressor, entry column)], ``raw`` per compressor [T, 2 * width], in the tail's column order."""
    new = raw[0] if len(raw) == 1 else torch.cat(raw, dim=-1)  # [T, tail width]
    tail = cache.tail[..., : new.shape[1]]
    if plan.entries:
        old = tail[plan.old_slots, plan.old_rows]  # [M, tail width], read before this step's rows overwrite the ring
        src = torch.cat([old.to(new.dtype), new])[plan.source]  # [N, span, tail width]
        col = 0
        for comp, entry_col in compressors:
            entry = comp.pool(src[..., col : col + 2 * comp.width], plan.positions, rope)
            cache.entries[plan.blocks, plan.offsets, entry_col : entry_col + comp.dim] = entry.to(cache.entries.dtype)
            col += 2 * comp.width
    if plan.keep.numel():
        tail[plan.keep_slots, plan.keep_rows] = new[plan.keep].to(tail.dtype)


@dataclass(frozen=True)
class TopkPlan:
    """Which rows the indexer ranks, grouped by the width it ranks them over (a prompt row: the
    prompt's entries; a later row: its visible ones). ``torch.topk``'s choice among exact ties
    depends on the row length, which the reference fixes this way; one top-k per distinct width."""

    rows: torch.Tensor  # [Nr] flat rows ranked, ordered by group
    ranking: frozenset[int]  # requests with a ranked row
    groups: tuple[tuple[int, int, int], ...]  # (start, stop, width): rows[start:stop] rank over width entries
    n_max: int  # entries of the longest request after this step


def topk_plan(batch: V4Batch, ratio: int, topk: int, device) -> TopkPlan | None:
    """None where no row of the batch ranks more than ``topk`` entries (nothing is scored)."""
    a, n, s, e, req_t, i, p, rows = _layout(batch)
    prompt = np.array(batch.prompt_lens or (0,) * len(a), dtype=np.int64)
    todo = np.maximum(e, prompt) // ratio > topk
    if not todo.any():
        return None
    in_prompt = np.where(prompt > 0, np.clip(prompt - s, 0, n), n)  # rows of each request still in its prompt
    prompt_width = np.where(prompt > 0, np.maximum(e // ratio, prompt // ratio), e // ratio)
    is_prompt = i < in_prompt[req_t]
    width = np.where(is_prompt, prompt_width[req_t], (p + 1) // ratio)
    ranked = todo[req_t] & (is_prompt | (width > topk))
    order = np.argsort(width[ranked], kind="stable")
    chosen, widths = rows[ranked][order], width[ranked][order]
    cuts = np.flatnonzero(np.diff(widths)) + 1
    bounds = np.concatenate([[0], cuts, [len(widths)]])
    groups = tuple((int(lo), int(hi), int(widths[lo])) for lo, hi in zip(bounds[:-1], bounds[1:]))
    (rows_dev,) = _upload([chosen], device)
    return TopkPlan(rows_dev, frozenset(int(r) for r in np.unique(req_t[ranked])), groups, int(e.max()) // ratio)


def torch_scores(indexer, q, weights, entries, key_col: int, visible, batch: V4Batch, plan: TopkPlan) -> torch.Tensor:
    """Masked scores [T, n_max] (``sum_h w_h * relu(q_h . key) * scale``, -inf past each row's
    visible entries; rows of requests that rank nothing stay -inf): what a platform's
    ``index_scores`` computes in one launch. Here one GEMM per ranking request, against its own
    keys (a request's rows share them; a per-row form would copy the keys once per row)."""
    ratio, dim, n_max = indexer.ratio, indexer.dim, plan.n_max
    out = q.new_full((q.shape[0], n_max), float("-inf"), dtype=torch.float32)
    per_block = batch.block_size // ratio
    ids = torch.arange(n_max, device=q.device)
    for r, (a, b) in enumerate(batch.token_ranges):
        n = (batch.starts[r] + b - a) // ratio
        if r not in plan.ranking or not n:
            continue
        blocks = batch.block_tables[r].long()[ids[:n] // per_block]
        keys = entries[blocks, ids[:n] % per_block, key_col : key_col + dim]  # [n, dI]
        scores = torch.relu(torch.matmul(q[a:b].float(), keys.float().t())) * dim**-0.5  # [t, h, n]
        scores = (scores * weights[a:b].unsqueeze(-1)).sum(dim=1)  # [t, n]
        out[a:b, :n] = scores.masked_fill(ids[None, :n] >= visible[a:b, None], float("-inf"))
    return out


def choose(scores: torch.Tensor, visible: torch.Tensor, plan: TopkPlan, topk: int, out: torch.Tensor) -> None:
    """Top-k of every ranked row into ``out`` [T, topk] (ids a row cannot see yet: -1), one
    ``topk`` per group; ``scores`` [Nr, n_max] in the plan's row order."""
    for lo, hi, width in plan.groups:
        rows = scores[lo:hi, :width]
        if width > rows.shape[1]:  # a prompt row ranks over the whole prompt's entries: the future ones at -inf
            rows = torch.cat([rows, rows.new_full((hi - lo, width - rows.shape[1]), float("-inf"))], dim=1)
        k = min(topk, width)
        top = rows.topk(k, dim=-1).indices
        index = plan.rows[lo:hi]
        out[index, :k] = torch.where(top >= visible[index][:, None], -1, top)

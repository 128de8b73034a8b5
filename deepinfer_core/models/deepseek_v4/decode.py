"""DeepSeek-V4 decode step with fixed shapes and no host synchronisation (CUDA-graph capturable).

The general V4 step (``deepseek_v4_compress``) reads the batch layout back to the host and loops
over requests: which requests close a compression window, how many entries the indexer ranks and
whether it ranks at all depend on the positions. A captured graph must replay the same kernels
with the same shapes whatever the positions, so this step, for batches of one new token per
request, does the same arithmetic for every request every step:

* each compressor pools the window that the new token is in (ring rows of the state tail plus
  the new row) and writes the entry where that window closes now; elsewhere it writes the entry
  slot's own value back (a no-op), so the write's shape never changes;
* the indexer scores every entry slot the block table can address (``entries_cap``), masked
  past each token's visible entries, and takes ``index_topk`` of them where more than
  ``index_topk`` are visible, else every visible entry in id order (the general path's rule).

Same values as the general path, in batched form; only the order of a chosen set and the width
of the ``-1`` padding differ (attention sums over the set). All per-request data are device
tensors (:class:`V4DecodeBatch`); nothing here calls ``.item()``, ``.tolist()`` or ``nonzero``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .kv import V4LayerCache
from .layers import V4Rope


@dataclass(frozen=True)
class V4DecodeBatch:
    """Device-side view of a decode batch (one new token per request), shared by every layer."""

    positions: torch.Tensor  # [R] int64, each request's new token
    slots: torch.Tensor  # [R] int64, state-KV slot of each request
    block_tables: torch.Tensor  # [R, max_blocks] int
    block_size: int
    # what the layers of one kind compute alike from the positions, computed once (shared())
    _shared: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def shared(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``'s result, built by the first layer that asks for ``key`` in this step and
        reused by the others (the batch is made per forward and dropped with it)."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def entries_cap(self, ratio: int) -> int:
        """Entry slots a block table row addresses: the fixed width of the indexer's scores."""
        return self.block_tables.shape[1] * (self.block_size // ratio)

    def entry_blocks(self, entries: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset) of entry ids ``entries`` [R, n] (each row its request's)."""
        per_block = self.block_size // ratio
        blocks = self.block_tables.long().gather(1, (entries // per_block).clamp(0, self.block_tables.shape[1] - 1))
        return blocks, entries % per_block


def decode_update_entries(
    compressors, raw: list[torch.Tensor], cache: V4LayerCache, batch: V4DecodeBatch, rope: V4Rope, fused=None
) -> None:
    """Decode-batch form of ``update_entries``: ``compressors`` [(compressor, entry column)],
    ``raw`` [R, 2 * width] projections of each request's new token. ``fused`` (optional, from
    the attention backend: ``V4AttentionBackend.compress_decode``) does one compressor's tail
    write and closing-window entry in one call, returning False to decline (the torch ops run)."""
    tail, tail_rows = cache.tail, cache.tail.shape[1]
    s = batch.positions
    ratio = compressors[0][0].ratio
    window = batch.shared(("window", ratio), lambda: torch.div(s, ratio, rounding_mode="floor"))
    cos, sin = rope.window_cos_sin(s, ratio, raw[0].dtype)  # each entry is roped at its window's first position
    tail_col = 0
    for (comp, entry_col), new in zip(compressors, raw):
        r, d, W = comp.ratio, comp.dim, comp.width
        if fused is not None and fused(comp, new, cache, tail_col, entry_col, batch, cos, sin):
            tail_col += 2 * W
            continue
        span = 2 * r if comp.overlap else r  # rows a closing window pools: its own (+ the previous window's)
        back = torch.arange(1 - span, 0, device=s.device)  # the span - 1 positions before the new token
        ring = (s[:, None] + back[None, :]).remainder(tail_rows)
        cols = slice(tail_col, tail_col + 2 * W)
        old = tail[batch.slots[:, None], ring, cols]  # [R, span - 1, 2W]
        src = torch.cat([old.to(new.dtype), new[:, None]], dim=1)  # [R, span, 2W], positions s-span+1..s
        cur = src[:, span - r :]
        kv, gate = cur[..., :W], cur[..., W:] + comp.position_bias
        if comp.overlap:  # window w's first half: window w - 1's rows (none for window 0: weight 0)
            prev = src[:, :r]
            has_prev = (window >= 1)[:, None, None]
            kv = torch.cat([torch.where(has_prev, prev[..., :d], torch.zeros_like(prev[..., :d])), kv[..., d:]], dim=1)
            prev_gate = torch.where(has_prev, prev[..., W : W + d] + comp.position_bias[:, :d], float("-inf"))
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        pooled = comp.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        entry = V4Rope.apply(pooled, cos, sin).to(cache.entries.dtype)  # [R, d]
        blocks, offsets = batch.entry_blocks(window[:, None], r)
        blocks, offsets = blocks[:, 0], offsets[:, 0]
        target = cache.entries[..., entry_col : entry_col + d]
        closes = ((s + 1) % r == 0)[:, None]
        target[blocks, offsets] = torch.where(closes, entry, target[blocks, offsets])
        tail[batch.slots, s.remainder(tail_rows), cols] = new.to(tail.dtype)
        tail_col += 2 * W


def decode_select(indexer, x, q_residual, cache: V4LayerCache, batch: V4DecodeBatch, rope: V4Rope, key_col: int,
                  scorer=None, cos_sin=None, apply=V4Rope.apply) -> torch.Tensor:  # fmt: skip
    """Decode-batch form of ``Indexer.select``: [R, index_topk] entry ids, -1 where none.
    ``scorer`` as there (``V4AttentionBackend.index_scores``, called with ``n_max`` =
    :meth:`V4DecodeBatch.entries_cap`); ``cos_sin`` the layer's own rope at the positions (the
    same values, not computed twice) and ``apply`` its rope function (a platform's kernel)."""
    R, ratio, k = x.shape[0], indexer.ratio, indexer.topk
    positions = batch.positions
    visible, every_visible, ranks = batch.shared(("visible", ratio, k), lambda: _visible(positions, ratio, k))
    cap = batch.entries_cap(ratio)
    if cap <= k:  # no row can see more than k entries
        return every_visible
    cos, sin = rope.cos_sin(positions, x.dtype) if cos_sin is None else cos_sin
    q = apply(indexer.q_b_proj(q_residual).view(R, indexer.heads, indexer.dim), cos, sin)
    weights = indexer.scorer.weights_proj(x).float() * indexer.heads**-0.5  # [R, h]
    scale = indexer.dim**-0.5
    scores = None if scorer is None else scorer(q, weights, cache.entries, key_col, positions, batch, ratio, cap, scale)
    if scores is None:
        slots = torch.arange(cap, device=x.device).expand(R, -1)
        blocks, offsets = batch.entry_blocks(slots, ratio)
        keys = cache.entries[blocks, offsets, key_col : key_col + indexer.dim].float()  # [R, cap, dI]
        scores = F.relu(torch.matmul(q.float(), keys.transpose(1, 2))) * scale  # [R, h, cap]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)
        scores = scores.masked_fill(slots >= visible[:, None], float("-inf"))
    top = scores.topk(k, dim=-1).indices
    return torch.where(ranks, top, every_visible)


def _visible(positions: torch.Tensor, ratio: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entries each request sees [R], every visible id for rows with <= k of them [R, k] (-1
    padded), whether a row ranks [R, 1]): the same for every indexer layer of a ratio."""
    visible = torch.div(positions + 1, ratio, rounding_mode="floor")  # [R]
    ids = torch.arange(k, device=positions.device)
    every_visible = torch.where(ids[None, :] < visible[:, None], ids[None, :], -1)  # rows with <= k entries
    return visible, every_visible, (visible > k)[:, None]

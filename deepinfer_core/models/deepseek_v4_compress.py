"""DeepSeek-V4 compressors (CSA / HCA) and the CSA lightning indexer, on the paged V4 cache.

A compressor turns every ``ratio`` source positions into one entry: softmax over the window of
``gate + position_bias`` weights ``kv``, summed, RMS-normed, roped at the window's first
position. CSA windows overlap: entry ``w`` pools window ``w``'s second-half projections with
window ``w - 1``'s first-half ones (``2 * ratio`` slots). Raw projections of positions not yet
in a finished window (and, for CSA, of the previous window) live in the request's state tail;
finished entries go to block KV (see ``deepseek_v4_kv``). Each call emits exactly the entries
whose windows close inside the scheduled tokens, so any chunking gives the same entries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .deepseek_v4_config import V4Config
from .deepseek_v4_kv import V4LayerCache
from .deepseek_v4_layers import V4RMSNorm, V4Rope


@dataclass(frozen=True)
class V4Batch:
    """Host-side view of the flat batch, built once per forward and shared by every layer."""

    token_ranges: tuple[tuple[int, int], ...]  # rows [a, b) of each request in the flat batch
    starts: tuple[int, ...]  # position of each request's first new token
    slots: tuple[int, ...]  # state-KV slot of each request
    block_tables: torch.Tensor  # [R, max_blocks] int
    block_size: int
    prompt_lens: tuple[int, ...] = ()  # per request, 0 where unknown

    def entry_index(self, r: int, entries: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset) of compressed entries ``entries`` [n] of request ``r``."""
        per_block = self.block_size // ratio
        blocks = self.block_tables[r].long()[entries // per_block]
        return blocks, entries % per_block


def read_tail(tail: torch.Tensor, slot: int, lo: int, hi: int) -> torch.Tensor:
    rows = tail.shape[1]
    return tail[slot, torch.arange(lo, hi, device=tail.device) % rows]


def write_tail(tail: torch.Tensor, slot: int, start: int, new: torch.Tensor) -> None:
    """Keep the last ``rows`` positions of ``new`` (positions start..) in the ring."""
    rows = tail.shape[1]
    end = start + new.shape[0]
    lo = max(start, end - rows)
    tail[slot, torch.arange(lo, end, device=tail.device) % rows] = new[lo - start :].to(tail.dtype)


class Compressor(nn.Module):
    """One compressed series (``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``).
    ``overlap`` (CSA): projections are two series wide, window ``w`` borrows ``w - 1``'s first half."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap, self.width = dim, ratio, overlap, width
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, 2 * width] (kv | gate)
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def compress(self, src: torch.Tensor, lo: int, windows: range, rope: V4Rope) -> torch.Tensor:
        """Entries for ``windows`` from raw rows ``src`` of positions ``lo..`` -> [n, dim]."""
        r, d, n = self.ratio, self.dim, len(windows)
        first = windows.start * r - lo
        cur = src[first : first + n * r].view(n, r, 2 * self.width)
        kv, gate = cur[..., : self.width], cur[..., self.width :] + self.position_bias
        if self.overlap:
            new_kv = kv.new_zeros(n, 2 * r, d)
            new_gate = gate.new_full((n, 2 * r, d), float("-inf"))
            new_kv[:, r:], new_gate[:, r:] = kv[..., d:], gate[..., d:]
            # Window w's first half is window w - 1's rows (window 0 has none: weight 0), all at once.
            skip = 1 if windows.start == 0 else 0
            if n > skip:
                first_prev = (windows.start + skip - 1) * r - lo
                prev = src[first_prev : first_prev + (n - skip) * r].view(n - skip, r, 2 * self.width)
                new_kv[skip:, :r] = prev[..., :d]
                new_gate[skip:, :r] = prev[..., self.width : self.width + d] + self.position_bias[:, :d]
            kv, gate = new_kv, new_gate
        pooled = self.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        positions = torch.arange(windows.start, windows.stop, device=src.device) * r
        cos, sin = rope.cos_sin(positions, pooled.dtype)
        return V4Rope.apply(pooled, cos, sin)


def update_entries(
    compressors: list[tuple[Compressor, int]],  # (compressor, first column in entries / tail)
    raw: list[torch.Tensor],  # per compressor, [T, 2 * width] projections of the flat batch
    cache: V4LayerCache,
    batch: V4Batch,
    rope: V4Rope,
    replay: bool = False,
) -> None:
    """Write every entry whose window closes in this step to block KV; refresh the state tails.
    A replay (rebuilding state after a prefix hit) only refreshes the tails: the entries are
    already in the shared cached blocks, and the replay's first positions are not exact."""
    ratio = compressors[0][0].ratio
    # A decode batch (one new token per request): only requests whose window closes run the
    # per-request compression; every tail is then refreshed with one indexed write per series.
    one_each = not replay and len(batch.token_ranges) > 1 and all(b - a == 1 for a, b in batch.token_ranges)
    for r, ((a, b), s, slot) in enumerate(zip(batch.token_ranges, batch.starts, batch.slots)):
        e = s + (b - a)
        lo = max(0, (s // ratio) * ratio - (ratio if compressors[0][0].overlap else 0))
        windows = range(s // ratio, e // ratio)
        if one_each and not len(windows):
            continue
        tail_col = 0
        for (comp, entry_col), rows in zip(compressors, raw):
            width = 2 * comp.width
            new = rows[a:b]
            if len(windows) and not replay:
                old = read_tail(cache.tail[..., tail_col : tail_col + width], slot, lo, s)
                src = torch.cat([old.to(new.dtype), new], dim=0)
                entries = comp.compress(src, lo, windows, rope)
                blocks, offsets = batch.entry_index(r, torch.arange(windows.start, windows.stop, device=new.device), ratio)
                cache.entries[blocks, offsets, entry_col : entry_col + comp.dim] = entries.to(cache.entries.dtype)
            if not one_each:
                write_tail(cache.tail[..., tail_col : tail_col + width], slot, s, new)
            tail_col += width
    if one_each:
        dev = cache.tail.device
        rows_of = torch.tensor([a for a, _ in batch.token_ranges], device=raw[0].device)
        slots = torch.tensor(batch.slots, device=dev)
        ring = torch.tensor(batch.starts, device=dev) % cache.tail.shape[1]
        tail_col = 0
        for (comp, _), rows in zip(compressors, raw):
            width = 2 * comp.width
            cache.tail[..., tail_col : tail_col + width][slots, ring] = rows[rows_of].to(cache.tail.dtype)
            tail_col += width


class Indexer(Compressor):
    """Lightning indexer: its own overlapping compressor at ``index_head_dim`` (keys stored beside
    the CSA entries) and a scorer ``sum_h w_h * relu(q_h . k)`` choosing ``index_topk`` entries."""

    def __init__(self, cfg: V4Config, ratio: int) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, ratio, True, cfg.rms_norm_eps)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)

    def select(self, x, q_residual, positions, cache: V4LayerCache, batch: V4Batch, rope: V4Rope, key_col: int, scorer=None) -> torch.Tensor:
        """Top-k entry indices per token ([T, k], -1 where nothing is chosen; k = index_topk, or
        fewer when no row of the batch has that many entries).

        A row that ranks no more than ``index_topk`` entries chooses every visible one: it gets
        them in id order without scoring (the set top-k would return; the order means nothing,
        attention is a sum over the set). So up to ``index_topk * ratio`` tokens of context the
        indexer computes nothing. ``scorer`` (optional, from the attention backend:
        ``V4AttentionBackend.index_scores``) computes every row's masked scores in one call
        instead of the per-request torch ops below (``None`` from it: use them); the top-k that
        follows is the same either way."""
        T = x.shape[0]
        visible_all = (positions + 1) // self.ratio  # entries each query may see
        ends = [s + b - a for (a, b), s in zip(batch.token_ranges, batch.starts)]
        prompts = batch.prompt_lens or (0,) * len(ends)
        todo = [r for r, e in enumerate(ends) if max(e, prompts[r]) // self.ratio > self.topk]  # requests that rank > topk entries
        # no ranking at all: only as many columns as the batch has entries (attention reads fewer -1 slots)
        width = self.topk if todo else max(1, min(self.topk, max(ends, default=0) // self.ratio))
        ids = torch.arange(width, device=x.device)
        out = torch.where(ids[None, :] < visible_all[:, None], ids[None, :], -1)
        if not todo:
            return out
        cos, sin = rope.cos_sin(positions, x.dtype)
        q = V4Rope.apply(self.q_b_proj(q_residual).view(T, self.heads, self.dim), cos, sin)
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [T, h]
        n_max = max(ends) // self.ratio
        every = None
        if scorer is not None:
            every = scorer(q, weights, cache.entries, key_col, positions, batch, self.ratio, n_max, self.dim**-0.5)  # [T, n_max]
        for r in todo:
            (a, b), s = batch.token_ranges[r], batch.starts[r]
            n = ends[r] // self.ratio
            visible = visible_all[a:b]
            if every is not None:
                scores = every[a:b, :n]
            else:
                blocks, offsets = batch.entry_index(r, torch.arange(n, device=x.device), self.ratio)
                keys = cache.entries[blocks, offsets, key_col : key_col + self.dim]  # [n, dI]
                scores = torch.matmul(q[a:b].float(), keys.float().t())  # [t, h, n]
                scores = F.relu(scores) * self.dim**-0.5
                scores = (scores * weights[a:b].unsqueeze(-1)).sum(dim=1)  # [t, n]
                future = torch.arange(n, device=x.device)[None, :] >= visible[:, None]
                scores = scores.masked_fill(future, float("-inf"))
            self._top(scores, visible, prompts[r], s, out[a:b])
        return out

    def _top(self, scores: torch.Tensor, visible: torch.Tensor, prompt: int, start: int, out: torch.Tensor) -> None:
        """Top-k of each row, ranked over the entries a one-pass run would rank it over: a
        prompt row over the prompt's ``prompt // ratio`` entries (future ones at -inf), a later
        row over its visible ones, as decoding does. Exact score ties (relu makes many zeros)
        are then broken as the reference breaks them whatever the chunking; ``torch.topk``'s
        choice among ties depends on the row length."""
        t, n = scores.shape
        in_prompt = min(t, max(0, prompt - start)) if prompt else t
        if in_prompt:
            cols = max(n, prompt // self.ratio) if prompt else n
            rows = scores[:in_prompt]
            if cols > n:
                rows = torch.cat([rows, rows.new_full((in_prompt, cols - n), float("-inf"))], dim=1)
            k = min(self.topk, cols)
            top = rows.topk(k, dim=-1).indices
            out[:in_prompt, :k] = torch.where(top >= visible[:in_prompt, None], -1, top)
        for i in range(in_prompt, t):
            cols = (start + i + 1) // self.ratio  # = visible[i], known on the host (no device sync)
            if cols > self.topk:  # fewer: ``out`` already holds every visible entry
                out[i] = scores[i, :cols].topk(self.topk).indices

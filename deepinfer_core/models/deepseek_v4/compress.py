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

import torch
import torch.nn as nn

from ..layers import FusedLinear
from .batch import StepPlans, V4Batch
from .config import V4Config
from .kv import V4LayerCache
from .layers import V4RMSNorm, V4Rope
from .prefill import choose, topk_plan, torch_scores, update_entries_batched, window_plan


class Compressor(nn.Module):
    """One compressed series (``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``).
    ``overlap`` (CSA): projections are two series wide, window ``w`` borrows ``w - 1``'s first half."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap, self.width = dim, ratio, overlap, width
        # kv_proj and gate_proj (the checkpoint's two tensors) as one product: one GEMV a
        # compressor and decode step instead of two and the concatenation
        self.proj = FusedLinear(hidden, {"kv_proj": width, "gate_proj": width})
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(dim, eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, 2 * width] (kv | gate)
        return self.proj(x)

    def pool(self, src: torch.Tensor, positions: torch.Tensor, rope: V4Rope) -> torch.Tensor:
        """Entries from windows of raw rows ``src`` [N, span, 2 * width] (span = ``2 * ratio``
        with overlap: the previous window's rows first, ignored for window 0; else ``ratio``),
        roped at ``positions`` [N] (each window's first position) -> [N, dim]."""
        r, d, W = self.ratio, self.dim, self.width
        if self.overlap:  # window w's first half: window w - 1's rows (none for window 0: weight 0)
            prev, cur = src[:, :r], src[:, r:]
            has_prev = (positions >= r)[:, None, None]
            kv = torch.cat(
                [torch.where(has_prev, prev[..., :d], torch.zeros_like(prev[..., :d])), cur[..., d:W]], dim=1
            )
            first = torch.where(has_prev, prev[..., W : W + d] + self.position_bias[:, :d], float("-inf"))
            gate = torch.cat([first, cur[..., W + d :] + self.position_bias[:, d:]], dim=1)
        else:
            kv, gate = src[..., :W], src[..., W:] + self.position_bias
        pooled = self.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        cos, sin = rope.cos_sin(positions, pooled.dtype)
        return V4Rope.apply(pooled, cos, sin)


def update_entries(
    compressors: list[tuple[Compressor, int]],  # (compressor, first column in entries / tail)
    raw: list[torch.Tensor],  # per compressor, [T, 2 * width] projections of the flat batch
    cache: V4LayerCache,
    batch: V4Batch,
    rope: V4Rope,
    replay: bool = False,
    plans: StepPlans | None = None,  # the forward's (None: plans for this call alone)
) -> None:
    """Write every entry whose window closes in this step to block KV; refresh the state tails.
    A replay (rebuilding state after a prefix hit) only refreshes the tails: the entries are
    already in the shared cached blocks, and the replay's first positions are not exact.
    Every request at once (:mod:`.deepseek_v4_prefill`)."""
    comp = compressors[0][0]
    plan = (plans or StepPlans()).get(
        ("windows", comp.ratio, comp.overlap, cache.tail.shape[1], replay),
        lambda: window_plan(batch, comp.ratio, comp.overlap, cache.tail.shape[1], replay, raw[0].device),
    )  # fmt: skip
    update_entries_batched(compressors, raw, cache, plan, rope)


class Indexer(Compressor):
    """Lightning indexer: its own overlapping compressor at ``index_head_dim`` (keys stored beside
    the CSA entries) and a scorer ``sum_h w_h * relu(q_h . k)`` choosing ``index_topk`` entries."""

    def __init__(self, cfg: V4Config, ratio: int) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, ratio, True, cfg.rms_norm_eps)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)

    def select(
        self,
        x,
        q_residual,
        positions,
        cache: V4LayerCache,
        batch: V4Batch,
        rope: V4Rope,
        key_col: int,
        scorer=None,
        plans: StepPlans | None = None,
    ) -> torch.Tensor:
        """Top-k entry indices per token ([T, k], -1 where nothing is chosen; k = index_topk, or
        fewer when no row of the batch has that many entries).

        A row that ranks no more than ``index_topk`` entries chooses every visible one: it gets
        them in id order without scoring (the set top-k would return; the order means nothing,
        attention is a sum over the set). So up to ``index_topk * ratio`` tokens of context the
        indexer computes nothing. ``scorer`` (optional, from the attention backend:
        ``V4AttentionBackend.index_scores``) computes every row's masked scores in one call
        instead of the torch ops (``None`` from it: use them); the top-k that follows is the
        same either way. Every request and row at once (:mod:`.deepseek_v4_prefill`)."""
        T = x.shape[0]
        visible = (positions + 1) // self.ratio  # entries each query may see
        plan = (plans or StepPlans()).get(
            ("topk", self.ratio, self.topk), lambda: topk_plan(batch, self.ratio, self.topk, x.device)
        )
        # no ranking at all: only as many columns as the batch has entries (attention reads fewer -1 slots)
        ends = [s + b - a for (a, b), s in zip(batch.token_ranges, batch.starts)]
        width = self.topk if plan is not None else max(1, min(self.topk, max(ends, default=0) // self.ratio))
        ids = torch.arange(width, device=x.device)
        out = torch.where(ids[None, :] < visible[:, None], ids[None, :], -1)
        if plan is None:
            return out
        cos, sin = rope.cos_sin(positions, x.dtype)
        q = V4Rope.apply(self.q_b_proj(q_residual).view(T, self.heads, self.dim), cos, sin)
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [T, h]
        every = None
        if scorer is not None:
            every = scorer(
                q, weights, cache.entries, key_col, positions, batch, self.ratio, plan.n_max, self.dim**-0.5
            )  # [T, n_max]
        if every is None:
            every = torch_scores(self, q, weights, cache.entries, key_col, visible, batch, plan)
        choose(every[plan.rows], visible, plan, self.topk, out)
        return out

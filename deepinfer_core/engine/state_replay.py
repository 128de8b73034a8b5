"""Rebuilding per-request state KV after a prefix-cache hit (or a resume), by replaying tokens.

A prefix hit hands a request its cached blocks (block KV), but its state KV (window rings,
compressor tails) is gone. It is a function of the layer inputs at the last few positions before
the hit, and layer ``l``'s input at position ``p`` is exact once the replay has covered ``l``
windows before ``p`` (each layer's attention looks ``window - 1`` positions back; the first
layer's input is the token embedding, exact everywhere). So re-running the model over the last
``exact_replay_tokens`` tokens before the hit, reading block KV but never writing it, leaves the
state exactly as a full prefill would (``swa_replay="exact"``): ~``layers * (window - 1)`` tokens.

``swa_replay="compact"`` re-runs only the last ``keep`` tokens (DeepSeek recommends 140 for a
128-token window), whatever the depth: a constant cost, approximately right. The replay's window
attention is bounded to the replayed tokens (the attention backends read no ring rows before a
replay's first position, ``AttentionMetadata.replay``), so the state depends on those tokens and
the cached blocks only, never on what the slot held before. Its error is measured, not assumed:
``benchmarks/kv/swa_replay.py`` (KL and greedy agreement against exact replay).

Before replaying, the window cache (engine/window_cache.py) is asked for the state at the hit:
a hit there copies it into the slot and nothing is replayed.

::

    prefix hit at s, no state slot ──> window cache hit? ── yes ──> restore, no replay
                                                 └─ no ──> replay tokens [s - n, s), n = exact or keep
"""

from __future__ import annotations

from collections import Counter

from .scheduler import ScheduledRequest, SchedulerOutput
from .window_cache import WindowCache


class StateRebuild:
    """How one engine rebuilds state KV: the replay length of its mode, and its window cache
    (None: off). Counts replayed tokens per request (``Request.num_replayed_tokens``, reported in
    ``RequestOutput.metrics``) and in all."""

    def __init__(
        self,
        state,
        block_size: int,
        exact_tokens: int,
        mode: str = "exact",
        keep: int = 0,
        min_keep: int = 0,
        window_cache: WindowCache | None = None,
    ) -> None:
        if mode not in ("exact", "compact"):
            raise ValueError(f"unknown swa_replay {mode!r}; use exact or compact")
        if mode == "compact" and keep < min_keep:
            raise ValueError(
                f"swa_replay_keep={keep} is too small for this model: a compact replay must re-run at least "
                f"{min_keep} tokens (the window ring and compressor tails a later step reads), so use "
                f"--swa-replay-keep {min_keep} or more"
            )
        self.state = state  # StateKVSlots
        self.block_size = block_size
        self.mode = mode
        # compact never replays more than exact would: past that it is exact already
        self.replay_tokens = exact_tokens if mode == "exact" else min(keep, exact_tokens)
        self.window_cache = window_cache
        self.counters: Counter[str] = Counter()

    def replays(self, sched: SchedulerOutput, requests: dict) -> SchedulerOutput | None:
        """The replay step for scheduled requests that start past position 0 without a state
        slot (prefix hit or resume after preemption), after the window cache served what it
        holds; None when nothing is replayed."""
        out = []
        for s in sched.requests:
            if s.start_position == 0 or self.state.holds(s.request_id):
                continue
            req = requests[s.request_id]
            if self._restore(req, s.start_position):
                req.window_cache_hits += 1
                continue
            lo = max(0, s.start_position - self.replay_tokens)
            if lo == s.start_position:
                continue
            tokens = req.token_slice(lo, s.start_position)
            out.append(ScheduledRequest(s.request_id, tuple(tokens), lo, s.block_ids, False, s.seed, s.prompt_len))
            req.num_replayed_tokens += len(tokens)
            self.counters["replays"] += 1
            self.counters["replayed_tokens"] += len(tokens)
        if not out:
            return None
        return SchedulerOutput(tuple(out), sum(len(r.token_ids) for r in out))

    def _restore(self, req, start: int) -> bool:
        cache = self.window_cache
        if cache is None or start % self.block_size or start // self.block_size > len(req.block_keys):
            return False
        key = req.block_keys[start // self.block_size - 1]
        return cache.restore(key, lambda: self.state.slot(req.request_id))

    def after_step(self, sched: SchedulerOutput, requests: dict) -> None:
        """Save the state of requests this step left exactly on a block boundary (window cache).
        Serial steps only, right after the step's forward: with a later step already queued
        behind it (overlapped scheduling) the slot would be copied after that step moved it on,
        under this boundary's key. Not called there, the window cache only misses (replays)."""
        if self.window_cache is None:
            return
        bs = self.block_size
        for s in sched.requests:
            end = s.start_position + len(s.token_ids)
            if end % bs:
                continue
            req = requests.get(s.request_id)
            if req is None or req.num_computed_tokens != end or end // bs > len(req.block_keys):
                continue  # gone, or not every scheduled token committed (the state may hold rejected drafts)
            if not self.state.holds(s.request_id):
                continue
            self.window_cache.capture(s.request_id, self.state.owner[s.request_id], req.block_keys[end // bs - 1])

    def stats(self) -> dict:
        out = {
            "swa_replay": self.mode,
            "swa_replays": self.counters["replays"],
            "swa_replayed_tokens": self.counters["replayed_tokens"],
        }
        if self.window_cache is not None:
            out.update(self.window_cache.stats())
        return out

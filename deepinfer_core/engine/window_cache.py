"""The short-lived window cache: sliding-window state of finished requests, kept in host memory.

A prefix hit gives a DeepSeek-V4 request its block KV (compressed entries), but its state KV (each
layer's window ring and compressor tails) must be rebuilt by replay (engine/state_replay.py). The
commonest hit is a conversation's next turn: its prompt repeats the previous request's prompt and
output, and its prefix hit ends at the last block boundary the previous request crossed. So while
a request runs, its state is copied to host memory each time a step leaves it exactly on a block
boundary (one pending copy per request, overwritten at the next boundary)::

    step ends at position 3 * 128:   slot state  ──copy──>  pending[request]   (key: block 2's hash)
    request finishes / is preempted:  pending[request]  ──>  entries (expire after ttl_s; oldest
                                                             evicted past max_bytes)
    later request, prefix hit at 384 with that key, no state slot yet:
                                      entries[key]  ──copy──>  its slot         (no replay)

The key is the hash-chain key of the block that ends at the boundary, which names the whole prefix
(and the engine's namespace: model, layout, block size), so a hit is the same tokens on the same
instance. Entries live only here: never in the persistent KV store, gone after ``ttl_s`` seconds
of a monotonic clock (injectable for tests) or when the byte bound needs their room.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["WindowCache", "state_tensors"]


@dataclass
class _Entry:
    tensors: list[torch.Tensor]  # host copies of the slot's state tensors, in the cache's order
    nbytes: int
    stored_at: float = 0.0


class WindowCache:
    """Host copies of state-KV slots, keyed by the prefix they were computed for.

    ``state``: per layer, the state tensors whose first dimension is the slot (for DeepSeek-V4
    ``[cache.window, cache.tail]``). ``ttl_s``: seconds an entry is served after its request
    left; ``max_bytes``: the most host memory the entries and the running requests' pending
    copies hold together (a new pending copy first evicts the oldest entries; when the pending
    copies alone fill it, a request is not captured and its later hits replay)."""

    def __init__(
        self,
        state: Sequence[torch.Tensor],
        ttl_s: float,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = list(state)
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # oldest first
        self.pending: dict[str, tuple[bytes, _Entry]] = {}  # request id -> its latest boundary copy
        self.nbytes = 0  # held by entries
        self.pending_bytes = 0  # held by pending copies
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in self.state)
        self._pin = any(t.device.type != "cpu" for t in self.state)
        self.queries = 0  # rebuilds looked up here (a request past position 0 without state)
        self.hits = 0
        self.evicted = 0
        self.expired = 0
        self.not_captured = 0  # boundaries not saved: the bound was full of pending copies

    # -- producing ----------------------------------------------------------------------------
    def capture(self, request_id: str, slot: int, key: bytes) -> None:
        """Copy ``slot``'s state (now exactly at the boundary ``key`` ends) as the request's
        pending entry, replacing its previous one (whose buffers are reused)."""
        old = self.pending.get(request_id)
        if old is not None:
            entry = old[1]
        else:
            if self.ttl_s <= 0 or not self._make_room(self.slot_bytes):
                self.not_captured += 1
                return
            entry = _Entry([torch.empty(t.shape[1:], dtype=t.dtype, pin_memory=self._pin) for t in self.state], 0)
            entry.nbytes = self.slot_bytes
            self.pending_bytes += entry.nbytes
        for host, tensor in zip(entry.tensors, self.state):
            host.copy_(tensor[slot], non_blocking=self._pin)  # stream-ordered before any later step
        self.pending[request_id] = (key, entry)

    def release(self, request_id: str, slot: int) -> None:
        """The request gave its slot back (finished or preempted): its pending copy becomes an
        entry (``StateKVSlots.on_release``)."""
        got = self.pending.pop(request_id, None)
        if got is None:
            return
        key, entry = got
        self.pending_bytes -= entry.nbytes  # its room was made at capture: it moves, no eviction
        self.expire()
        if key in self.entries:
            self.nbytes -= self.entries.pop(key).nbytes
        entry.stored_at = self.clock()
        self.entries[key] = entry
        self.nbytes += entry.nbytes

    def forget(self, request_id: str) -> None:
        """Drop a request's pending copy without keeping it."""
        got = self.pending.pop(request_id, None)
        if got is not None:
            self.pending_bytes -= got[1].nbytes

    def _make_room(self, nbytes: int) -> bool:
        """Evict the oldest entries until ``nbytes`` more fit; False when they cannot."""
        self.expire()
        while self.entries and self.nbytes + self.pending_bytes + nbytes > self.max_bytes:
            _, oldest = self.entries.popitem(last=False)
            self.nbytes -= oldest.nbytes
            self.evicted += 1
        return self.nbytes + self.pending_bytes + nbytes <= self.max_bytes

    # -- serving ------------------------------------------------------------------------------
    def restore(self, key: bytes, take_slot: Callable[[], int]) -> bool:
        """Copy the entry for ``key`` into the slot ``take_slot()`` gives (called on a hit
        only); False (a miss) when there is none."""
        self.queries += 1
        self.expire()
        entry = self.entries.get(key)
        if entry is None:
            return False
        slot = take_slot()
        for host, tensor in zip(entry.tensors, self.state):
            tensor[slot].copy_(host, non_blocking=self._pin)
        self.hits += 1
        return True

    def expire(self) -> None:
        """Drop the entries older than ``ttl_s`` (the oldest are first)."""
        deadline = self.clock() - self.ttl_s
        while self.entries:
            key, entry = next(iter(self.entries.items()))
            if entry.stored_at > deadline:
                break
            del self.entries[key]
            self.nbytes -= entry.nbytes
            self.expired += 1

    def stats(self) -> dict:
        return {
            "window_cache_queries": self.queries,
            "window_cache_hits": self.hits,
            "window_cache_entries": len(self.entries),
            "window_cache_bytes": self.nbytes,
            "window_cache_evicted": self.evicted,
            "window_cache_expired": self.expired,
            "window_cache_not_captured": self.not_captured,
        }


def state_tensors(caches: Sequence) -> list[torch.Tensor]:
    """The per-slot state tensors of each layer's cache (DeepSeek-V4: ``window`` and ``tail``):
    every tensor field but the paged block KV (``entries``), in field order."""
    return [
        t for cache in caches for name, t in vars(cache).items() if name != "entries" and isinstance(t, torch.Tensor)
    ]

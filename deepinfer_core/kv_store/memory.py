"""``memory``: a KV store in this process's memory (tests, single runs, no persistence).

It implements the whole contract (two-phase writes, leases, LRU capacity, retention expiry,
holds) so that engine code tested against it behaves the same on the persistent stores. Its
holds live in this process, like its blocks.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from . import RETENTION_SECONDS, KVHold, KVStoreConfig, ReadLease, WriteTicket
from .leases import (
    HeldKeys,
    HoldTable,
    LeaseTable,
    TicketTable,
    check_buffers,
    check_hold_seconds,
    evict_to_capacity,
    pieces,
)

DEFAULT_RESERVATION_SECONDS = 300.0


@dataclass(frozen=True)
class _Block:
    data: bytes
    expires_at: float


class MemoryKVStore:
    """Dict-backed store. Options: ``retention_seconds`` (dict overriding
    :data:`RETENTION_SECONDS`), ``reservation_seconds`` (how long a write ticket lives)."""

    name = "memory"
    scatter_reads = True  # read_into takes a list of buffers per block (see KVStore)

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        from .local import check_retention_classes, parse_retention_option

        self._retention = check_retention_classes(
            {**RETENTION_SECONDS, **parse_retention_option(config.options.get("retention_seconds", {}))}
        )
        self._reservation_s = float(config.options.get("reservation_seconds", DEFAULT_RESERVATION_SECONDS))
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # LRU order: oldest first
        self._leases: LeaseTable[_Block] = LeaseTable()
        self._tickets = TicketTable()
        self._holds = HoldTable()
        self._lock = threading.Lock()
        self._counters = {"hits": 0, "misses": 0, "evictions": 0, "expired": 0, "commits": 0, "holds": 0}

    # -- reads ----------------------------------------------------------------------------
    def match_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            now, held = time.time(), HeldKeys(self._holds)
            for key in keys:
                if not self._live(key, now, held):  # expired blocks are not served, unless held
                    break
                n += 1
            return n

    def _live(self, key: bytes, now: float, held: HeldKeys) -> bool:
        block = self._blocks.get(key)
        return block is not None and (block.expires_at > now or held.keeps(key, now))

    def acquire_read(self, keys: Sequence[bytes]) -> ReadLease:
        with self._lock:
            now, held = time.time(), HeldKeys(self._holds)
            present = [k for k in keys if self._live(k, now, held)]
            for key in present:
                self._blocks.move_to_end(key)  # a read is a use (LRU)
            return self._leases.acquire(keys, present)

    def read_into(self, lease: ReadLease, buffers: Sequence[memoryview]) -> list[bool]:
        check_buffers(lease.keys, buffers, self.config.block_bytes)
        with self._lock:
            pinned = self._leases.pinned_keys(lease)
            results = []
            for key, buffer in zip(lease.keys, buffers):
                block = self._blocks.get(key) if key in pinned else None
                if block is None and key in pinned:
                    block = self._leases.retired(key)
                if block is None:
                    self._counters["misses"] += 1
                    results.append(False)
                    continue
                offset = 0
                for piece in pieces(buffer):  # one buffer, or a scatter list
                    piece[:] = memoryview(block.data)[offset : offset + len(piece)]
                    offset += len(piece)
                self._counters["hits"] += 1
                results.append(True)
            return results

    def release(self, lease: ReadLease) -> None:
        with self._lock:
            self._leases.release(lease)  # retired bytes are simply dropped
            self._evict_to_capacity()

    # -- writes ---------------------------------------------------------------------------
    def reserve_write(self, keys: Sequence[bytes], retention: str = "chat") -> WriteTicket:
        if retention not in self._retention:
            raise ValueError(f"unknown retention class {retention!r}; known: {sorted(self._retention)}")
        with self._lock:
            now = time.time()
            needed = [k for k in dict.fromkeys(keys) if k not in self._blocks or self._blocks[k].expires_at <= now]
            return self._tickets.open(needed, retention, time.time() + self._reservation_s).ticket

    def write_from(self, ticket: WriteTicket, buffers: Sequence[memoryview]) -> None:
        check_buffers(ticket.keys, buffers, self.config.block_bytes)
        copies = [bytes(memoryview(b).cast("B")) for b in buffers]
        with self._lock:
            reservation = self._tickets.get(ticket)
            reservation.written.update(zip(ticket.keys, copies))

    def commit(self, ticket: WriteTicket, ok_mask: Sequence[bool]) -> int:
        if len(ok_mask) != len(ticket.keys):
            raise ValueError(f"ok_mask has {len(ok_mask)} entries for {len(ticket.keys)} ticket keys")
        now = time.time()
        with self._lock:
            reservation = self._tickets.close(ticket)
            expires_at = now + self._retention[reservation.retention]
            made = 0
            for key, ok in zip(ticket.keys, ok_mask):
                data = reservation.written.get(key)
                old = self._blocks.get(key)
                if old is not None and old.expires_at <= now:
                    self._drop(key)  # written again after its retention ended: replace it
                    old = None
                if not ok or data is None or old is not None:
                    continue  # first commit of a key wins
                self._blocks[key] = _Block(data, expires_at)
                made += 1
            self._counters["commits"] += made
            self._evict_to_capacity()
            return made

    # -- removal --------------------------------------------------------------------------
    def remove(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._drop(key)

    def gc(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self._lock:
            self._holds.expire(now)
            held = HeldKeys(self._holds, now).keys()
            expired = [k for k, b in self._blocks.items() if b.expires_at <= now and k not in held]
            for key in expired:
                self._drop(key)
            self._counters["expired"] += len(expired)
            return len(expired) + len(self._tickets.expire(now))

    def _drop(self, key: bytes) -> None:
        block = self._blocks.pop(key, None)
        if block is not None and self._leases.is_pinned(key):
            self._leases.retire(key, block)

    def _evict_to_capacity(self) -> None:
        """Down to capacity: expired blocks first, then least recently used."""
        self._counters["evictions"] += evict_to_capacity(
            self._blocks, self.config.capacity_blocks, self._leases, lambda key, block: None, HeldKeys(self._holds)
        )

    # -- holds ----------------------------------------------------------------------------
    def hold(self, keys: Sequence[bytes], seconds: float) -> KVHold:
        """Keep the live blocks among ``keys`` readable for ``seconds``, past their retention."""
        seconds = check_hold_seconds(seconds)
        with self._lock:
            now, held = time.time(), HeldKeys(self._holds)
            self._counters["holds"] += 1
            return self._holds.add([k for k in dict.fromkeys(keys) if self._live(k, now, held)], now + seconds)

    def release_hold(self, hold: KVHold) -> None:
        with self._lock:
            self._holds.remove(hold)

    # -- misc -----------------------------------------------------------------------------
    def retention_seconds(self) -> dict[str, float]:
        """Each retention class's lifetime in seconds (the engine's writer uses it to know
        when a block it wrote has expired and must be written again when it reappears)."""
        return dict(self._retention)

    def stats(self) -> dict:
        with self._lock:
            return {
                "blocks": len(self._blocks),
                "bytes": sum(len(b.data) for b in self._blocks.values()),
                "leases": len(self._leases),
                "reservations": len(self._tickets),
                **self._counters,
            }

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()

"""Lease and reservation bookkeeping shared by every KV store backend.

Two tables, no I/O and no locking of their own (the store holds its lock around them):

- :class:`LeaseTable` counts read pins per key. A pinned key must not be evicted or deleted;
  when a store removes one anyway (``remove``, expiry, eviction pressure) it *retires* it: the
  key is gone for new lookups at once and its backing value (bytes, a file path) is handed
  back to the store for deletion when the last lease on it ends.
- :class:`TicketTable` holds write reservations: which keys a ticket may still write, which
  were written, its retention class and when it expires. Expired tickets are returned by
  :meth:`TicketTable.expire` so the store can delete their temporary data.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

from . import ReadLease, StaleTicketError, WriteTicket

V = TypeVar("V")


class LeaseTable(Generic[V]):
    """Read pins. ``V`` is what the store needs to read or delete a retired block."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._pinned_by_lease: dict[int, tuple[bytes, ...]] = {}
        self._pins: Counter[bytes] = Counter()
        self._retired: dict[bytes, V] = {}

    def acquire(self, requested: Sequence[bytes], pinned: Sequence[bytes]) -> ReadLease:
        """A lease over ``requested`` that pins ``pinned`` (the committed subset)."""
        lease = ReadLease(next(self._ids), tuple(requested))
        self._pinned_by_lease[lease.lease_id] = tuple(pinned)
        self._pins.update(pinned)
        return lease

    def pinned_keys(self, lease: ReadLease) -> frozenset[bytes]:
        """Keys this lease pins; empty for an unknown or released lease."""
        return frozenset(self._pinned_by_lease.get(lease.lease_id, ()))

    def is_pinned(self, key: bytes) -> bool:
        return self._pins[key] > 0

    def retire(self, key: bytes, value: V) -> None:
        """Hide a pinned key; ``value`` comes back from :meth:`release` when unpinned."""
        self._retired[key] = value

    def retired(self, key: bytes) -> V | None:
        """The retired value of a still-pinned key (so leases can keep reading it)."""
        return self._retired.get(key)

    def retired_values(self) -> list[V]:
        """Everything retired and still pinned (e.g. paths a bulk delete must spare)."""
        return list(self._retired.values())

    def forget_retired(self, key: bytes) -> None:
        """Drop a retired entry whose data is already gone (a bad record)."""
        self._retired.pop(key, None)

    def release(self, lease: ReadLease) -> list[tuple[bytes, V]]:
        """End a lease (idempotent); return retired blocks that nobody pins any more."""
        keys = self._pinned_by_lease.pop(lease.lease_id, ())
        freed: list[tuple[bytes, V]] = []
        for key in keys:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]
                if key in self._retired:
                    freed.append((key, self._retired.pop(key)))
        return freed

    def __len__(self) -> int:
        return len(self._pinned_by_lease)


@dataclass
class Reservation:
    ticket: WriteTicket
    retention: str
    written: dict[bytes, Any] = field(default_factory=dict)  # key -> store data (bytes, temp path)


class TicketTable:
    """Open write reservations, by ticket id."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: dict[int, Reservation] = {}

    def open(self, keys: Sequence[bytes], retention: str, expires_at: float) -> Reservation:
        ticket = WriteTicket(next(self._ids), tuple(keys), expires_at)
        reservation = Reservation(ticket, retention)
        self._open[ticket.ticket_id] = reservation
        return reservation

    def get(self, ticket: WriteTicket) -> Reservation:
        """The live reservation for ``ticket``; raises :class:`StaleTicketError` otherwise."""
        reservation = self._open.get(ticket.ticket_id)
        if reservation is None or reservation.ticket != ticket:
            raise StaleTicketError(f"write ticket {ticket.ticket_id} expired, was committed, or is not this store's")
        return reservation

    def close(self, ticket: WriteTicket) -> Reservation:
        """Remove and return the reservation (for commit)."""
        reservation = self.get(ticket)
        del self._open[ticket.ticket_id]
        return reservation

    def expire(self, now: float) -> list[Reservation]:
        """Remove and return reservations whose ``expires_at`` has passed."""
        gone = [r for r in self._open.values() if r.ticket.expires_at <= now]
        for reservation in gone:
            del self._open[reservation.ticket.ticket_id]
        return gone

    def live_temp_values(self) -> set:
        """Every store value held by an open reservation (e.g. temp paths not to sweep)."""
        return {value for r in self._open.values() for value in r.written.values()}

    def __len__(self) -> int:
        return len(self._open)


def pieces(buffer) -> list[memoryview]:
    """A block's destination as byte views: one buffer, or a list of them (a scatter list)."""
    parts = buffer if isinstance(buffer, (list, tuple)) else [buffer]
    return [memoryview(part).cast("B") for part in parts]


def check_buffers(keys: Sequence[bytes], buffers: Sequence[memoryview], block_bytes: int) -> None:
    """One buffer (or scatter list) per key, each exactly one block (why: a size mismatch
    means the caller's layout disagrees with the store's namespace, which must fail loudly,
    not truncate)."""
    if len(buffers) != len(keys):
        raise ValueError(f"{len(buffers)} buffers for {len(keys)} keys")
    for buffer in buffers:
        nbytes = sum(p.nbytes for p in pieces(buffer))
        if nbytes != block_bytes:
            raise ValueError(f"buffer of {nbytes} bytes; blocks are {block_bytes} bytes")


def eviction_victims(
    keys_oldest_first, size: int, capacity: int | None, leases: LeaseTable, expired: Sequence[bytes] = ()
) -> list[bytes]:
    """The unpinned keys to drop so that ``size`` comes down to ``capacity``: ``expired`` keys
    first (past their retention, worth nothing), then the least recently used.

    Invariant: a pinned block is never evicted, so a store may sit above capacity until its
    leases end (stores call their eviction again from ``release``)."""
    if capacity is None or size <= capacity:
        return []
    order = dict.fromkeys(itertools.chain(expired, keys_oldest_first)) if expired else keys_oldest_first
    unpinned = (k for k in order if not leases.is_pinned(k))
    return list(itertools.islice(unpinned, size - capacity))


def evict_to_capacity(entries, capacity: int | None, leases: LeaseTable, drop: Callable[[bytes, object], None]) -> int:
    """Bring ``entries`` (key -> entry with ``expires_at``, least recently used first) down to
    ``capacity`` by :func:`eviction_victims`, popping each victim and handing it to ``drop``
    (a store's own clean-up: nothing for memory, the record file for disk); returns how many
    went. One loop for every store, so their eviction order cannot drift apart."""
    if capacity is None or len(entries) <= capacity:
        return 0
    now = time.time()
    expired = [k for k, e in entries.items() if e.expires_at <= now]
    victims = eviction_victims(entries, len(entries), capacity, leases, expired)
    for key in victims:
        drop(key, entries.pop(key))
    return len(victims)

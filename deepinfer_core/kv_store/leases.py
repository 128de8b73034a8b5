"""Lease and reservation bookkeeping shared by every KV store backend.

Two tables, no I/O and no locking of their own (the store holds its lock around them):

- :class:`LeaseTable` counts read pins per key. A pinned key must not be evicted or deleted;
  when a store removes one anyway (``remove``, expiry, eviction pressure) it *retires* it: the
  key is gone for new lookups at once and its backing value (bytes, a file path) is handed
  back to the store for deletion when the last lease on it ends.
- :class:`TicketTable` holds write reservations: which keys a ticket may still write, which
  were written, its retention class and when it expires. Expired tickets are returned by
  :meth:`TicketTable.expire` so the store can delete their temporary data.

Holds (:class:`~deepinfer_core.kv_store.KVHold`, blocks kept past their retention for a reader
in another process) have two tables with one interface, ``add`` / ``remove`` / ``deadlines`` /
``expire``: :class:`HoldTable` in memory (the ``memory`` store) and :class:`HoldFiles`, one file
per hold in the store's directory (the file-backed stores: every process sharing the directory
sees, honours and may release a hold, and it outlives the process that took it).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Sequence, TypeVar

from . import KVHold, ReadLease, StaleTicketError, WriteTicket

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


class HoldTable:
    """Holds in this process's memory, by hold id."""

    def __init__(self) -> None:
        self._holds: dict[str, KVHold] = {}

    def add(self, keys: Sequence[bytes], expires_at: float) -> KVHold:
        hold = KVHold(secrets.token_hex(16), tuple(keys), expires_at)
        self._holds[hold.hold_id] = hold
        return hold

    def remove(self, hold: KVHold) -> bool:
        """Drop a hold; False when it was not there (released, expired, another store's)."""
        return self._holds.pop(hold.hold_id, None) is not None

    def deadlines(self, now: float) -> dict[bytes, float]:
        """Each held key's latest deadline among the holds still running at ``now``."""
        return _latest((h.keys, h.expires_at) for h in self._holds.values() if h.expires_at > now)

    def expire(self, now: float) -> int:
        """Remove holds whose deadline has passed; return how many."""
        gone = [i for i, h in self._holds.items() if h.expires_at <= now]
        for hold_id in gone:
            del self._holds[hold_id]
        return len(gone)


HOLD_SUFFIX = ".hold"
_HOLD_ID = re.compile(r"[0-9a-f]{32}")


class HoldFiles:
    """Holds as files ``<directory>/<hold id>.hold`` holding JSON ``{"expires_at": seconds,
    "keys": [hex, ...]}``, written whole (a temp file renamed into place), so that a reader
    never sees half a hold. Nothing is cached: every :meth:`deadlines` reads the directory
    (stores call it only when a block past its retention is met, and in ``gc``). A symlink at
    ``directory`` is never followed (it is read as empty and removed by :meth:`expire`)."""

    def __init__(self, directory: str | os.PathLike, stale_seconds: float = 300.0) -> None:
        self.directory = Path(directory)
        self.stale_seconds = stale_seconds  # a temp file older than this was left by a dead writer

    def add(self, keys: Sequence[bytes], expires_at: float) -> KVHold:
        hold = KVHold(secrets.token_hex(16), tuple(keys), expires_at)
        if os.path.islink(self.directory) or (os.path.lexists(self.directory) and not self.directory.is_dir()):
            os.unlink(self.directory)
        self.directory.mkdir(exist_ok=True)
        tmp = self.directory / f"{hold.hold_id}.tmp"
        body = json.dumps({"expires_at": expires_at, "keys": [k.hex() for k in hold.keys]}).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, self._path(hold.hold_id))
        return hold

    def remove(self, hold: KVHold) -> bool:
        """Delete a hold's file; False when it was not there. An id that is not one of ours
        (it names a path) is refused as not there, never followed."""
        if not isinstance(hold.hold_id, str) or not _HOLD_ID.fullmatch(hold.hold_id):
            return False
        try:
            os.unlink(self._path(hold.hold_id))
        except FileNotFoundError:
            return False
        return True

    def deadlines(self, now: float) -> dict[bytes, float]:
        """Each held key's latest deadline among the holds still running at ``now``; a file
        that does not parse is no hold."""
        return _latest(hold for _, hold, _ in self._scan() if hold is not None and hold[1] > now)

    def expire(self, now: float) -> int:
        """Delete hold files past their deadline, files that do not parse, and temp files left
        by dead writers; return how many holds went."""
        if os.path.islink(self.directory):
            os.unlink(self.directory)
            return 0
        count = 0
        for entry, hold, mtime in self._scan(temps=True):
            if entry.name.endswith(HOLD_SUFFIX):
                if hold is not None and hold[1] > now:
                    continue
                count += 1
            elif mtime + self.stale_seconds > now:
                continue  # a hold being written
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass  # another process's gc
        return count

    def _path(self, hold_id: str) -> Path:
        return self.directory / f"{hold_id}{HOLD_SUFFIX}"

    def _scan(self, temps: bool = False):
        """``(entry, (keys, expires_at) or None, mtime)`` for each hold file (and temp file)."""
        if os.path.islink(self.directory):
            return
        try:
            entries = list(os.scandir(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if not entry.is_file(follow_symlinks=False):
                continue
            if not entry.name.endswith(HOLD_SUFFIX):
                if temps:
                    try:
                        yield entry, None, entry.stat(follow_symlinks=False).st_mtime
                    except FileNotFoundError:
                        pass
                continue
            try:
                with open(entry.path, "rb") as f:
                    data = json.loads(f.read())
                hold = (tuple(bytes.fromhex(k) for k in data["keys"]), float(data["expires_at"]))
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError, KeyError, TypeError):
                hold = None
            yield entry, hold, 0.0


def _latest(holds) -> dict[bytes, float]:
    until: dict[bytes, float] = {}
    for keys, expires_at in holds:
        for key in keys:
            if until.get(key, 0.0) < expires_at:
                until[key] = expires_at
    return until


class HeldKeys:
    """The hold deadlines one store operation needs, read from its hold table on first use
    (most operations meet no block past its retention and never read them)."""

    def __init__(self, table: HoldTable | HoldFiles, now: float | None = None) -> None:
        self._table = table
        self._now = now
        self._until: dict[bytes, float] | None = None

    def _deadlines(self) -> dict[bytes, float]:
        if self._until is None:
            self._until = self._table.deadlines(time.time() if self._now is None else self._now)
        return self._until

    def until(self, key: bytes) -> float:
        """When the hold on ``key`` ends (0.0: not held)."""
        return self._deadlines().get(key, 0.0)

    def keeps(self, key: bytes, now: float) -> bool:
        return self.until(key) > now

    def keys(self) -> set[bytes]:
        """Every held key."""
        return set(self._deadlines())


def check_hold_seconds(seconds) -> float:
    """A hold's length: a positive, finite number of seconds (ValueError otherwise)."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < float("inf"):
        raise ValueError(f"hold: seconds must be a positive number, got {seconds!r}")
    return float(seconds)


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


def evict_to_capacity(
    entries,
    capacity: int | None,
    leases: LeaseTable,
    drop: Callable[[bytes, object], None],
    held: HeldKeys | None = None,
) -> int:
    """Bring ``entries`` (key -> entry with ``expires_at``, least recently used first) down to
    ``capacity`` by :func:`eviction_victims`, popping each victim and handing it to ``drop``
    (a store's own clean-up: nothing for memory, the record file for disk); returns how many
    went. One loop for every store, so their eviction order cannot drift apart. A block past
    its retention that ``held`` keeps is not taken first as expired: it goes in LRU order."""
    if capacity is None or len(entries) <= capacity:
        return 0
    now = time.time()
    expired = [k for k, e in entries.items() if e.expires_at <= now and (held is None or not held.keeps(k, now))]
    victims = eviction_victims(entries, len(entries), capacity, leases, expired)
    for key in victims:
        drop(key, entries.pop(key))
    return len(victims)

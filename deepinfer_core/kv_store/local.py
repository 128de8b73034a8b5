"""``local``: the embedded default KV store, one file per block in a directory.

Layout (``root`` is ``config.path``, default ``~/.cache/deepinfer/kv``)::

    root/<namespace fp hex>/
        tmp/<key hex>.<pid>.<token>.<ticket>.tmp      written by write_from, private to a ticket
        <retention>/<expiry day>/<key hex[:2]>/<key hex>.kv   committed records (records.py)
        holds/<hold id>.hold                          holds (leases.HoldFiles), any process's

Why this shape: a commit is one ``os.replace`` of a complete temp file, so a crash leaves
either nothing or a whole record, never half of one. Records are bucketed by the UTC day they
expire in, so expiry deletes whole directories (3FS has no TTL; the 3fs plugin reuses this
class on its mount). The namespace directory keeps models apart; the header check still
turns a misplaced file into a miss.

The index (key -> path, LRU order) lives in memory and is rebuilt from a directory scan on
open, so the cache survives restarts. A key missing from the index is looked up on disk
before it is called a miss, so several processes sharing one directory see each other's
commits. Leases are per process: another process deleting a file makes a read fail, which is
a miss (recompute), never wrong data.

Counters: each process counts its own hits, misses, commits, ... and writes them to its file
under ``counters/`` (at most once a second while they change, and when the store closes or the
process exits), so that ``deepinfer kv stats`` shows what every process that used the store did
(:meth:`LocalDiskKVStore.shared_stats`); files not updated for 30 days are removed by ``gc``.

Expiry: a block past its retention is a miss at once (lookups are metadata only and delete
nothing); its file is deleted by ``gc`` (``deepinfer kv gc``, or the engine's periodic one), by
capacity eviction (expired blocks go first), or replaced when the block is written again.
Records are bucketed by expiry day, so only the current day's bucket needs its records'
headers read to know their exact expiry (at open, and in ``gc``).

Holds (``hold`` / ``release_hold``, see :mod:`deepinfer_core.kv_store`): a file per hold under
``holds/``, so a hold taken by one process (prefill) is honoured by the others (decode, any
``gc``) and outlives its taker. A block past its retention is served while a hold on it runs:
lookups and reads meeting such a block read the hold files (only then), and ``gc`` spares held
records, even in a day bucket that has ended, until their holds end or are released.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from . import RETENTION_SECONDS, KVHold, KVStoreConfig, ReadLease, WriteTicket
from .leases import (
    HeldKeys,
    HoldFiles,
    LeaseTable,
    TicketTable,
    check_buffers,
    check_hold_seconds,
    evict_to_capacity,
    pieces,
)
from .records import (
    HEADER_BYTES,
    PosixRecordIO,
    RecordIO,
    decode_header,
    is_regular_file,
    key_from_filename,
    namespace_fingerprint,
    read_record,
    record_bytes,
    record_filename,
    remove_file,
    write_record,
)

__all__ = ["LocalDiskKVStore"]


log = logging.getLogger(__name__)
DEFAULT_PATH = "~/.cache/deepinfer/kv"
DAY = 86400
DEFAULT_RESERVATION_SECONDS = 300.0
COUNTERS_DIR = "counters"
COUNTER_FLUSH_SECONDS = 1.0  # a process's counters file is rewritten at most this often
COUNTER_FILE_DAYS = 30  # gc removes counter files not updated for this long
HOLDS_DIR = "holds"
READ_SLACK_S = 60.0  # a read of a block this close to its expiry looks for a hold on it first


@dataclass(frozen=True)
class _Entry:
    path: str
    expires_at: float  # end of the record's day bucket


def _bucket_end(day: int) -> float:
    return float((day + 1) * DAY)


_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]+")


def parse_retention_option(value) -> dict:
    """The ``retention_seconds`` option: a dict, or text ``chat:3600,agent:600`` (how a store
    URL spells it: ``local:///path?retention_seconds=chat:3600``)."""
    if not isinstance(value, str):
        return value
    out = {}
    for item in value.split(","):
        name, sep, seconds = item.partition(":")
        try:
            out[name.strip()] = float(seconds)
        except ValueError:
            raise ValueError(f"retention_seconds: {item!r} must be class:seconds, e.g. chat:3600") from None
        if not sep:
            raise ValueError(f"retention_seconds: {item!r} must be class:seconds, e.g. chat:3600")
    return out


def check_retention_classes(retention: dict) -> dict[str, float]:
    """Retention class names become directory names under the store root, so each must be one
    plain path component (why: ``..`` or ``/abs`` made the store write, and ``gc`` delete,
    outside its root). Raises ValueError naming the offending class."""
    for name, seconds in retention.items():
        if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
            raise ValueError(
                f"retention_seconds: class name {name!r} must be letters, digits, '_' or '-' "
                "(it becomes a directory name)"
            )
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < float("inf"):
            raise ValueError(f"retention_seconds[{name!r}] = {seconds!r}: must be a positive number of seconds")
    return {name: float(seconds) for name, seconds in retention.items()}


class LocalDiskKVStore:
    """File-per-block store. Options: ``retention_seconds`` (dict overriding
    :data:`RETENTION_SECONDS`), ``reservation_seconds``. ``io`` swaps the file I/O layer."""

    name = "local"
    scatter_reads = True  # read_into takes a list of buffers per block (see KVStore)

    def __init__(self, config: KVStoreConfig, *, io: RecordIO | None = None) -> None:
        self.config = config
        self.io: RecordIO = io or PosixRecordIO()
        self.root = LocalDiskKVStore.root_for(config)  # not the subclass's: config.path is final here
        self._fp = namespace_fingerprint(config.namespace)
        self._dir = self.root / self._fp.hex()
        self._tmp = self._dir / "tmp"
        self._retention = check_retention_classes(
            {**RETENTION_SECONDS, **parse_retention_option(config.options.get("retention_seconds", {}))}
        )
        self._open_layout()
        self._reservation_s = float(config.options.get("reservation_seconds", DEFAULT_RESERVATION_SECONDS))
        self._token = secrets.token_hex(4)  # temp names unique across processes on one mount
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU order: oldest first
        self._leases: LeaseTable[str] = LeaseTable()
        self._tickets = TicketTable()
        self._holds = HoldFiles(self._dir / HOLDS_DIR, self._reservation_s)
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(
            (
                "hits",
                "misses",
                "read_failures",
                "evictions",
                "expired",
                "commits",
                "commit_failures",
                "dropped_at_scan",
                "holds",
                "holds_released",
                "holds_expired",
            ),
            0,
        )
        self._counters_path = self._dir / COUNTERS_DIR / f"{_host_name()}.{os.getpid()}.{self._token}.json"
        self._flushed: dict[str, int] = dict(self._counters)
        self._flushed_at = 0.0
        # the last counts reach the file at exit even when nobody closes the store
        self._final_flush = weakref.finalize(self, _write_counters, self._counters_path, self._counters, self._flushed)
        _write_namespace_file(self._dir, config)
        with self._lock:
            self._rebuild_index()
            self._evict_to_capacity()

    def _open_layout(self) -> None:
        """Make ``<root>/<fp>/tmp`` directories. Inside the root the layout is the store's own, so
        a non-directory where a directory belongs (a stray file named ``tmp``) is removed and
        the directory made; a root that cannot be a directory is refused with one line (a
        ValueError, which every command prints as its error), never a traceback."""
        for path in (self.root, *self.root.parents):
            if os.path.lexists(path) and not os.path.isdir(path):
                raise ValueError(f"KV store path {str(self.root)!r}: {str(path)!r} is not a directory")
        try:
            for level in (self._dir, self._tmp):
                if os.path.islink(level) or (os.path.lexists(level) and not os.path.isdir(level)):
                    log.warning("KV store %s: %s was not a directory: replaced", self.root, level)
                _real_dir(level)
        except OSError as exc:
            raise ValueError(f"KV store path {str(self.root)!r} cannot be opened: {exc.strerror or exc}") from None

    @staticmethod
    def root_for(config: KVStoreConfig) -> Path:
        """The directory holding every namespace of this store (operator tools list it)."""
        return Path(os.path.expanduser(config.path or DEFAULT_PATH))

    # -- paths and index ------------------------------------------------------------------
    def _final_path(self, key: bytes, retention: str, day: int) -> Path:
        return self._dir / retention / str(day) / key.hex()[:2] / record_filename(key)

    def _rebuild_index(self) -> None:
        """Scan committed records (metadata only: names and sizes), oldest use first."""
        found: list[tuple[float, bytes, _Entry]] = []
        today = int(time.time() // DAY)
        for retention in self._retention:
            for day, day_dir in self._day_dirs(retention):
                if day < today:
                    continue  # wholly expired: gc deletes the bucket
                for item in _files_under(day_dir):
                    key = key_from_filename(item.name)
                    mtime, size = _mtime_size(item)
                    if key is None or size is None:  # not a record, or another gc removed it
                        continue
                    if size != record_bytes(key, self.config.block_bytes):
                        remove_file(item.path)  # truncated or foreign: never data
                        self._counters["dropped_at_scan"] += 1
                        continue
                    expires_at = self._record_expiry(item.path, key) if day == today else _bucket_end(day)
                    if expires_at is not None:
                        found.append((mtime, key, _Entry(item.path, expires_at)))
        for _, key, entry in sorted(found, key=lambda f: f[0]):
            self._index.pop(key, None)  # a key in two buckets: the newest copy wins
            self._index[key] = entry

    def _record_expiry(self, path: str, key: bytes) -> float | None:
        """The exact expiry a record's header holds (one small read), None for a bad header.
        Needed only in the current day's bucket: older buckets are wholly expired, newer ones
        wholly live for today."""
        head = bytearray(HEADER_BYTES + len(key))
        try:
            if self.io.read_file(path, 0, memoryview(head)) != len(head):
                return None
        except OSError:
            return None
        header = decode_header(head, self._fp, key)
        return None if header is None else header.expires_at

    def _day_dirs(self, retention: str) -> list[tuple[int, str]]:
        """The day buckets of a retention class: real directories only (a symlink planted in
        the tree is never followed: it would read, or let gc delete, files outside the root)."""
        top = self._dir / retention
        if os.path.islink(top):
            return []
        try:
            items = list(os.scandir(top))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [(int(d.name), d.path) for d in items if d.name.isdigit() and d.is_dir(follow_symlinks=False)]

    def _lookup(self, key: bytes, held: HeldKeys | None = None) -> _Entry | None:
        """Index first, then the disk (another process may have committed it). A block past
        its retention is a miss unless ``held`` keeps it (callers that serve reads pass it)."""
        entry = self._index.get(key)
        now = time.time()
        if entry is not None:
            # past its retention: a miss (unless held); gc or eviction deletes the file
            return entry if entry.expires_at > now or (held is not None and held.keeps(key, now)) else None
        if self._leases.retired(key) is not None:
            return None
        today = int(now // DAY)
        for retention in self._retention:
            for day, _ in self._day_dirs(retention):
                path = self._final_path(key, retention, day)
                if not is_regular_file(path) or os.path.islink(path.parent):  # a FIFO, directory or symlink: a miss
                    continue
                if _bucket_end(day) <= now and (held is None or not held.keeps(key, now)):
                    continue
                expires_at = self._record_expiry(str(path), key) if day <= today else _bucket_end(day)
                if expires_at is None or (expires_at <= now and (held is None or not held.keeps(key, now))):
                    continue
                entry = self._index[key] = _Entry(str(path), expires_at)
                return entry
        return None

    def _held(self, now: float | None = None) -> HeldKeys:
        return HeldKeys(self._holds, now)

    def record_path(self, key: bytes) -> str | None:
        """Where the committed record of ``key`` lives (for tools and tests), else None."""
        with self._lock:
            entry = self._lookup(key)
            return None if entry is None else entry.path

    # -- reads ----------------------------------------------------------------------------
    def match_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            held = self._held()
            for key in keys:
                if self._lookup(key, held) is None:
                    break
                n += 1
            return n

    def acquire_read(self, keys: Sequence[bytes]) -> ReadLease:
        with self._lock:
            held = self._held()
            present = [k for k in keys if self._lookup(k, held) is not None]
            for key in reversed(present):  # a prefix's head ends most recent: it outlives its tail
                self._index.move_to_end(key)
            return self._leases.acquire(keys, present)

    def read_into(self, lease: ReadLease, buffers: Sequence[memoryview]) -> list[bool]:
        check_buffers(lease.keys, buffers, self.config.block_bytes)
        with self._lock:
            pinned = self._leases.pinned_keys(lease)
            paths = [self._pinned_path(k) if k in pinned else None for k in lease.keys]
            held, soon = self._held(), time.time() + READ_SLACK_S
            kept = [0.0 if p is None or self._expiry(k) > soon else held.until(k) for k, p in zip(lease.keys, paths)]
        # I/O outside the lock: pinned files are not deleted by this process meanwhile.
        results = [
            path is not None
            and self._inside(path)
            and read_record(self.io, path, self._fp, key, pieces(buf), keep_until=until)
            for key, path, buf, until in zip(lease.keys, paths, buffers, kept)
        ]
        _touch([p for p, ok in zip(paths, results) if ok])  # LRU order for other processes
        with self._lock:
            for key, path, ok in zip(lease.keys, paths, results):
                self._counters["hits" if ok else "misses"] += 1
                if path is not None and not ok:
                    self._counters["read_failures"] += 1
                    self._discard_bad(key, path)
            self._flush_counters()
        return results

    def _expiry(self, key: bytes) -> float:
        entry = self._index.get(key)
        return 0.0 if entry is None else entry.expires_at

    def _pinned_path(self, key: bytes) -> str | None:
        entry = self._index.get(key)
        return entry.path if entry is not None else self._leases.retired(key)

    def _discard_bad(self, key: bytes, path: str) -> None:
        """A record that failed to read is removed: it would fail every time."""
        entry = self._index.get(key)
        if entry is not None and entry.path == path:
            del self._index[key]
        self._leases.forget_retired(key)
        self._remove_record(path)

    def _inside(self, path: str) -> bool:
        """False when a directory between the namespace directory and the record is a
        symlink (planted after the record was indexed): such a path is neither read nor
        deleted, since it leads outside the root. Three ``lstat`` calls per record."""
        parent = os.path.dirname(path)
        for _ in range(3):  # key prefix, day, retention
            if os.path.islink(parent):
                return False
            parent = os.path.dirname(parent)
        return parent == str(self._dir)

    def _remove_record(self, path: str) -> None:
        if self._inside(path):
            remove_file(path)

    def release(self, lease: ReadLease) -> None:
        with self._lock:
            for _key, path in self._leases.release(lease):
                self._remove_record(path)
            self._evict_to_capacity()

    # -- writes ---------------------------------------------------------------------------
    def reserve_write(self, keys: Sequence[bytes], retention: str = "chat") -> WriteTicket:
        if retention not in self._retention:
            raise ValueError(f"unknown retention class {retention!r}; known: {sorted(self._retention)}")
        with self._lock:
            needed = [k for k in dict.fromkeys(keys) if self._lookup(k) is None]
            return self._tickets.open(needed, retention, time.time() + self._reservation_s).ticket

    def write_from(self, ticket: WriteTicket, buffers: Sequence[memoryview]) -> None:
        check_buffers(ticket.keys, buffers, self.config.block_bytes)
        with self._lock:
            retention = self._tickets.get(ticket).retention
        expires_at = time.time() + self._retention[retention]
        written: dict[bytes, str] = {}
        try:
            for key, buffer in zip(ticket.keys, buffers):
                _real_dir(self._tmp)
                tmp = str(self._tmp / f"{key.hex()}.{os.getpid()}.{self._token}.{ticket.ticket_id}.tmp")
                remove_file(tmp)  # a second write_from on the same ticket replaces the first
                try:
                    try:
                        write_record(self.io, tmp, self._fp, key, memoryview(buffer).cast("B"), expires_at)
                    except FileNotFoundError:  # the store directory was deleted under us: start over
                        _real_dir(self._tmp)
                        write_record(self.io, tmp, self._fp, key, memoryview(buffer).cast("B"), expires_at)
                except BaseException:
                    remove_file(tmp)  # no partial record survives a failed write
                    raise
                written[key] = tmp
        finally:
            with self._lock:
                try:
                    self._tickets.get(ticket).written.update((k, (p, expires_at)) for k, p in written.items())
                except LookupError:  # expired while we wrote: nobody will commit these
                    for path in written.values():
                        remove_file(path)
                    raise

    def commit(self, ticket: WriteTicket, ok_mask: Sequence[bool]) -> int:
        if len(ok_mask) != len(ticket.keys):
            raise ValueError(f"ok_mask has {len(ok_mask)} entries for {len(ticket.keys)} ticket keys")
        with self._lock:
            reservation = self._tickets.close(ticket)
            made = 0
            published: list[str] = []
            held = self._held()
            for key, ok in zip(ticket.keys, ok_mask):
                written = reservation.written.get(key)
                if written is None:
                    continue
                tmp, expires_at = written
                old = self._index.get(key)
                if old is not None and old.expires_at <= time.time():
                    if held.keeps(key, time.time()):  # its file stays for the hold's readers; gc takes it later
                        del self._index[key]
                    else:
                        self._drop(key)  # written again after its retention ended: replace it
                    old = None
                # First commit wins; a retired key's file may still be read through a lease.
                if not ok or old is not None or self._leases.retired(key) is not None:
                    remove_file(tmp)
                    continue
                day = int(expires_at // DAY)
                final = self._final_path(key, reservation.retention, day)
                try:
                    self._publish(tmp, final)
                except OSError as exc:  # ENOSPC, a vanished root: this block is dropped
                    remove_file(tmp)
                    self._counters["commit_failures"] += 1
                    log.warning("KV store %s: commit of %s failed: %s", self._dir, key.hex()[:16], exc)
                    continue
                self._index[key] = _Entry(str(final), expires_at)  # exact; a scan knows the bucket only
                published.append(str(final))
                made += 1
            for key in reversed(
                [k for k in ticket.keys if self._index.get(k) is not None and self._index[k].path in published]
            ):
                self._index.move_to_end(key)  # the head of the written chain ends most recent
            _touch(published)
            self._counters["commits"] += made
            self._evict_to_capacity()
            self._flush_counters()
            return made

    @staticmethod
    def _publish(tmp: str, final: Path) -> None:
        """Rename a complete temp record into place. Whatever is not a regular file at the
        final path (a directory, a FIFO) is cleared first: it would be a miss forever."""
        for level in (final.parents[2], final.parents[1], final.parent):  # retention, day, key prefix
            _real_dir(level)
        if os.path.lexists(final) and not is_regular_file(final):
            remove_file(final)
        os.replace(tmp, final)  # atomic: readers see nothing or the whole record

    # -- removal --------------------------------------------------------------------------
    def remove(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                if key in self._index or self._lookup(key) is not None:
                    self._drop(key)

    def _drop(self, key: bytes) -> None:
        entry = self._index.pop(key)
        if self._leases.is_pinned(key):
            self._leases.retire(key, entry.path)
        else:
            self._remove_record(entry.path)

    def _evict_to_capacity(self) -> None:
        """Down to capacity: expired blocks first, then least recently used."""
        self._counters["evictions"] += evict_to_capacity(
            self._index,
            self.config.capacity_blocks,
            self._leases,
            lambda key, entry: self._remove_record(entry.path),
            self._held(),
        )

    def gc(self, now: float | None = None) -> int:
        """Expire records whose day bucket has ended, abandoned reservations of this process,
        temp files left by dead processes and holds past their deadline (any process's);
        returns how many blocks and reservations went. Held records are spared."""
        now = time.time() if now is None else now
        with self._lock:
            count = 0
            for reservation in self._tickets.expire(now):
                for tmp, _ in reservation.written.values():
                    remove_file(tmp)
                count += 1
            self._counters["holds_expired"] += self._holds.expire(now)
            held = self._held(now).keys()
            expired = [k for k, e in self._index.items() if e.expires_at <= now and k not in held]
            for key in expired:
                self._drop(key)
            self._counters["expired"] += len(expired)
            count += len(expired)
            in_use = {os.path.dirname(os.path.dirname(p)) for p in self._leases.retired_values()}
            today = int(now // DAY)
            for retention in self._retention:
                for day, day_dir in self._day_dirs(retention):
                    ended = _bucket_end(day) <= now
                    if ended and day_dir not in in_use and not self._holds_in(day_dir, held):
                        shutil.rmtree(day_dir, ignore_errors=True)  # whole bucket, any writer's
                    elif ended or day == today:  # records expiring today: their headers say when
                        count += self._gc_bucket(day_dir, now, held)
            live = {tmp for tmp, _ in self._tickets.live_temp_values()}
            if os.path.islink(self._tmp):  # never list (and delete in) a directory elsewhere
                remove_file(self._tmp)
            for item in _files_under(str(self._tmp), depth=0):
                if item.path not in live and _mtime_size(item)[0] + self._reservation_s <= now:
                    remove_file(item.path)
                    count += 1
            for item in _files_under(str(self._dir / COUNTERS_DIR), depth=0):  # not counted: not blocks
                if item.path != str(self._counters_path) and _mtime_size(item)[0] + COUNTER_FILE_DAYS * DAY <= now:
                    remove_file(item.path)
            self._flush_counters()
            return count

    @staticmethod
    def _holds_in(day_dir: str, held: set[bytes]) -> bool:
        """Whether a day bucket holds a record of a held key (one ``lstat`` per held key)."""
        return any(os.path.lexists(os.path.join(day_dir, k.hex()[:2], record_filename(k))) for k in held)

    def _gc_bucket(self, day_dir: str, now: float, held: set[bytes] = frozenset()) -> int:
        """Delete the expired records of one bucket (any writer's), sparing leased and held ones."""
        count = 0
        retired = set(self._leases.retired_values())
        for item in _files_under(day_dir):
            key = key_from_filename(item.name)
            if key is None or item.path in retired or key in held:
                continue
            expires_at = self._record_expiry(item.path, key)
            if expires_at is not None and expires_at > now:
                continue
            entry = self._index.get(key)
            if entry is not None and entry.path == item.path:
                self._drop(key)  # a leased one is retired, deleted when its lease ends
            else:
                remove_file(item.path)  # expired, or a bad header: never data
            self._counters["expired"] += 1
            count += 1
        return count

    # -- holds ----------------------------------------------------------------------------
    def hold(self, keys: Sequence[bytes], seconds: float) -> KVHold:
        """Keep the committed, live blocks among ``keys`` readable for ``seconds`` (a file under
        ``holds/``: every process sharing the store honours it, and it outlives this one)."""
        seconds = check_hold_seconds(seconds)
        with self._lock:
            held = self._held()
            live = [k for k in dict.fromkeys(keys) if self._lookup(k, held) is not None]
            hold = self._holds.add(live, time.time() + seconds)
            self._counters["holds"] += 1
            self._flush_counters()
            return hold

    def release_hold(self, hold: KVHold) -> None:
        """End a hold early, whichever process took it; its blocks expire as their retention says."""
        with self._lock:
            if self._holds.remove(hold):
                self._counters["holds_released"] += 1
                self._flush_counters()

    # -- misc -----------------------------------------------------------------------------
    def retention_seconds(self) -> dict[str, float]:
        """Each retention class's lifetime in seconds (the engine's writer uses it to know
        when a block it wrote has expired and must be written again when it reappears)."""
        return dict(self._retention)

    def stats(self) -> dict:
        with self._lock:
            now = time.time()
            live = [k for k, e in self._index.items() if e.expires_at > now]  # visible ones
            return {
                "blocks": len(live),
                "bytes": sum(record_bytes(k, self.config.block_bytes) for k in live),
                "expired_not_deleted": len(self._index) - len(live),  # until gc or eviction
                "leases": len(self._leases),
                "reservations": len(self._tickets),
                "path": str(self._dir),
                **self._counters,
            }

    def shared_stats(self) -> dict:
        """:meth:`stats` with the counters summed over every process that used this namespace
        (its ``counters/`` files, this process's written first), and ``processes``: how many
        files were summed. What ``deepinfer kv stats`` prints."""
        with self._lock:
            self._flush_counters(force=True)
        stats = self.stats()
        totals = dict.fromkeys(self._counters, 0)
        processes = 0
        counters_dir = self._dir / COUNTERS_DIR
        for item in [] if os.path.islink(counters_dir) else _files_under(str(counters_dir), depth=0):
            if not item.name.endswith(".json"):
                continue  # a file being written
            try:
                with open(item.path, encoding="utf-8") as f:
                    counts = json.load(f)
            except (OSError, ValueError):
                continue  # removed meanwhile, or not ours
            if not isinstance(counts, dict):
                continue
            processes += 1
            for name in totals:
                value = counts.get(name, 0)
                totals[name] += value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
        return {**stats, **totals, "processes": processes}

    def _flush_counters(self, force: bool = False) -> None:
        """Write this process's counters file if they changed (at most once a
        :data:`COUNTER_FLUSH_SECONDS` unless ``force``). Called with the lock held. A failure
        (full disk, a read-only mount) loses only counts, never blocks: logged once at debug."""
        if self._counters == self._flushed:
            return
        now = time.monotonic()
        if not force and now - self._flushed_at < COUNTER_FLUSH_SECONDS:
            return
        self._flushed_at = now
        _write_counters(self._counters_path, self._counters, self._flushed)

    def close(self) -> None:
        with self._lock:
            self._flush_counters(force=True)
            self._index.clear()


NAMESPACE_FILE = "namespace.json"


def _host_name() -> str:
    """This machine's name as one safe file-name component (several hosts share a 3FS mount)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def _write_counters(path: Path, counters: dict, flushed: dict) -> None:
    """Atomically (temp file + rename) write ``counters`` to ``path`` and record them in
    ``flushed``; nothing when nothing was counted since the last write."""
    if counters == flushed or not any(counters.values()):
        return
    snapshot = dict(counters)
    tmp = path.with_name(path.name + ".tmp")
    try:
        if os.path.islink(path.parent) or (os.path.lexists(path.parent) and not os.path.isdir(path.parent)):
            remove_file(path.parent)  # never written through a planted symlink
        path.parent.mkdir(exist_ok=True)  # not its parents: a deleted store stays deleted
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # as records are written
        try:
            os.write(fd, json.dumps(snapshot).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only or full store: counts are lost, nothing else
        log.debug("KV store: the counters file %s could not be written: %s", path, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return
    flushed.clear()
    flushed.update(snapshot)


def _write_namespace_file(directory: Path, config: KVStoreConfig) -> None:
    """``<fp>/namespace.json``: which namespace and block size a directory holds (why: an
    operator tool must open it with the right block size, or its scan would drop records)."""
    path = directory / NAMESPACE_FILE
    if path.exists():
        return
    tmp = directory / f"{NAMESPACE_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.write_text(json.dumps({"namespace": config.namespace, "block_bytes": config.block_bytes}))
    os.replace(tmp, path)


def stored_namespaces(root: str | os.PathLike) -> list[tuple[str, int]]:
    """(namespace, block_bytes) of every namespace directory under a store root."""
    found = []
    for item in sorted(os.scandir(root), key=lambda e: e.name) if os.path.isdir(root) else []:
        try:
            meta = json.loads((Path(item.path) / NAMESPACE_FILE).read_text())
            found.append((str(meta["namespace"]), int(meta["block_bytes"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a namespace directory (or one written before namespace.json)
    return found


def _files_under(directory: str, depth: int = 1) -> list[os.DirEntry]:
    """Files ``depth`` directory levels below ``directory``; vanished directories are empty
    (several processes may share, and gc, one root)."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    if depth == 0:
        return [e for e in entries if not e.is_dir(follow_symlinks=False)]
    return [f for e in entries if e.is_dir(follow_symlinks=False) for f in _files_under(e.path, depth - 1)]


def _real_dir(path: Path) -> None:
    """Make ``path`` a real directory: a symlink there (planted, or left by anything) is
    removed first, so that nothing is written through it to a place outside the root, and so is
    any other non-directory (a file where ``tmp/`` or a retention class belongs: with it there
    every write would fail)."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        remove_file(path)
    path.mkdir(parents=True, exist_ok=True)


LRU_STEP_NS = 10_000  # mtime step between a chain's blocks (above float mtime resolution)


def _touch(paths: Sequence[str]) -> None:
    """Record a use in the files' mtimes, the LRU order a restart (or another process)
    rebuilds: the first path (a prefix's head) gets the newest time, each next one
    :data:`LRU_STEP_NS` older, so eviction takes a chain's tail before its head (a tail
    without its head is never matched)."""
    now = time.time_ns()
    for i, path in enumerate(paths):
        try:
            os.utime(path, ns=(now - i * LRU_STEP_NS, now - i * LRU_STEP_NS), follow_symlinks=False)
        except OSError:
            pass  # gone meanwhile: nothing to order


def _mtime_size(entry: os.DirEntry) -> tuple[float, int | None]:
    """(mtime, size), or (inf, None) for a file that vanished meanwhile: nothing to do."""
    try:
        stat = entry.stat(follow_symlinks=False)  # a symlink's own size: never a record's
    except FileNotFoundError:
        return float("inf"), None
    return stat.st_mtime, stat.st_size

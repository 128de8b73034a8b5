"""KV storage backends: where full KV blocks live beyond device memory.

A backend is registered by name through ``deepinfer_register_kv_stores`` as a factory
``factory(config: KVStoreConfig) -> KVStore``. The engine calls the store directly.

Visibility rule (enforced by every backend, checked by the conformance suite): a block is
visible to ``match_prefix``/``acquire_read`` only after ``reserve_write`` -> ``write_from`` ->
``commit`` succeeded for it. A record that fails its header or checksum is a miss, never data.

Alignment rules (why: the caller keeps one list of buffers per request and must not guess):

- ``ReadLease.keys`` are the keys the caller asked for, in order; ``read_into`` takes one
  buffer per lease key and answers one bool per lease key. Keys that were not committed when
  the lease was taken are simply not pinned and read as False.
- ``WriteTicket.keys`` are the keys that still need writing (already committed keys are left
  out); ``write_from`` and ``commit`` take one buffer / one flag per ticket key.
- Every buffer is exactly ``KVStoreConfig.block_bytes`` long (a wrong size is a ValueError:
  it means the caller's layout disagrees with the namespace).

Concurrency: two tickets may reserve the same key; the first commit wins and later commits
of that key are dropped (blocks are content addressed, so either copy is right; what matters
is that a reader never sees a mix of two writes).

``remove`` and expiry hide a block at once; a lease taken earlier still reads it, and the
bytes are deleted when the last lease on it ends.

Holds (optional, :class:`KVStoreHolds`): a writer keeps blocks for a reader in another process
(prefill for decode) with ``hold(keys, seconds)``. Until the hold's deadline its blocks are
served and kept (``match_prefix``, ``acquire_read``, ``read_into``; expiry and ``gc`` spare
them) even past their retention; ``release_hold`` ends it early, from any process sharing the
store; a hold past its deadline is ignored and ``gc`` removes it. A hold covers only blocks
that are committed and live when it is taken (it never revives an expired one). Capacity
eviction counts a held block as live (it goes in least-recently-used order, not first as
expired) but may still take it: an evicted block is a miss, recomputed. The methods are not
part of :class:`KVStore`, so a store written before them keeps working: callers check
``isinstance(store, KVStoreHolds)`` and otherwise rely on retention alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

__all__ = [
    "KVHold",
    "KVStore",
    "KVStoreConfig",
    "KVStoreFactory",
    "KVStoreHolds",
    "RETENTION_SECONDS",
    "ReadLease",
    "StaleTicketError",
    "WriteTicket",
]


RETENTION_SECONDS = {"agent": 3 * 86400, "chat": 7 * 86400}


@dataclass(frozen=True)
class KVStoreConfig:
    """What a store is opened with. ``namespace`` fingerprints model, weights, KV dtype,
    layout, block size and parallel rank; records of another namespace are never returned."""

    namespace: str
    block_bytes: int
    path: str | None = None  # directory or mount point, for file-backed stores
    capacity_blocks: int | None = None
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ReadLease:
    """Blocks pinned for reading: they are not evicted or removed until released."""

    lease_id: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class WriteTicket:
    """Reserved, not yet visible, slots for blocks about to be written."""

    ticket_id: int
    keys: tuple[bytes, ...]
    expires_at: float


@dataclass(frozen=True)
class KVHold:
    """Blocks kept readable until ``expires_at`` (``time.time()`` seconds) for a reader that
    comes later, maybe from another process: ``hold_id`` names the hold in the store, so any
    process sharing it may release it. ``keys`` are those the hold covers (committed and live
    when it was taken), in the order asked."""

    hold_id: str
    keys: tuple[bytes, ...]
    expires_at: float


class StaleTicketError(LookupError):
    """``write_from``/``commit`` on a ticket that expired (``gc``), was committed already or
    belongs to another store. The writer drops the blocks; they are recomputed if needed."""


@runtime_checkable
class KVStore(Protocol):
    name: str

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are committed and readable (metadata only, no data read)."""
        ...

    def acquire_read(self, keys: Sequence[bytes]) -> ReadLease:
        """Pin the committed blocks among ``keys`` for reading."""
        ...

    def read_into(self, lease: ReadLease, buffers: Sequence[memoryview]) -> list[bool]:
        """Copy each leased block into its host buffer; False for a block that could not be
        read or failed verification (the caller recomputes from there). A store whose
        ``scatter_reads`` is true also takes, for a block, a list of buffers that its bytes
        fill back to back (the engine then reads straight into the KV cache's per-layer
        slices on the CPU, with no host-buffer hop)."""
        ...

    def release(self, lease: ReadLease) -> None:
        """End a read lease."""
        ...

    def reserve_write(self, keys: Sequence[bytes], retention: str = "chat") -> WriteTicket:
        """Reserve slots for new blocks (keys already committed are skipped by the store)."""
        ...

    def write_from(self, ticket: WriteTicket, buffers: Sequence[memoryview]) -> None:
        """Write the blocks' bytes; still invisible until :meth:`commit`. An I/O failure is
        raised (``OSError``) after cleaning up, and the blocks it hit are never visible."""
        ...

    def commit(self, ticket: WriteTicket, ok_mask: Sequence[bool]) -> int:
        """Make the written blocks with ``ok_mask`` True visible; drop the rest (and any block
        that was never written). Returns how many blocks became visible."""
        ...

    def remove(self, keys: Sequence[bytes]) -> None:
        """Delete blocks (leased ones are removed once their lease ends)."""
        ...

    def gc(self, now: float | None = None) -> int:
        """Expire blocks past their retention and abandoned reservations; return how many."""
        ...

    def stats(self) -> dict:
        """Counters. ``blocks`` (committed, visible blocks) is required; the rest (bytes,
        hits, misses, evictions, bad_records, ...) are the backend's own names."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class KVStoreHolds(Protocol):
    """The optional hold capability of a store (see the module docstring)."""

    def hold(self, keys: Sequence[bytes], seconds: float) -> KVHold:
        """Keep the committed, live blocks among ``keys`` readable for ``seconds``, past their
        retention if need be; the hold is visible to every process sharing the store."""
        ...

    def release_hold(self, hold: KVHold) -> None:
        """End a hold early (idempotent: an unknown or released hold is a no-op; an expired one
        is removed as ``gc`` would)."""
        ...


KVStoreFactory = Callable[[KVStoreConfig], KVStore]

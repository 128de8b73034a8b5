"""KV storage backends: where full KV blocks live beyond device memory.

A backend is registered by name through ``deepinfer_register_kv_stores`` as a factory
``factory(config: KVStoreConfig) -> KVStore``. The engine calls the store directly.

Visibility rule (enforced by every backend, checked by the conformance suite): a block is
visible to ``match_prefix``/``acquire_read`` only after ``reserve_write`` -> ``write_from`` ->
``commit`` succeeded for it. A record that fails its header or checksum is a miss, never data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

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
        read or failed verification (the caller recomputes from there)."""
        ...

    def release(self, lease: ReadLease) -> None:
        """End a read lease."""
        ...

    def reserve_write(self, keys: Sequence[bytes], retention: str = "chat") -> WriteTicket:
        """Reserve slots for new blocks (keys already committed are skipped by the store)."""
        ...

    def write_from(self, ticket: WriteTicket, buffers: Sequence[memoryview]) -> None:
        """Write the blocks' bytes; still invisible until :meth:`commit`."""
        ...

    def commit(self, ticket: WriteTicket, ok_mask: Sequence[bool]) -> None:
        """Make the written blocks with ``ok_mask`` True visible; drop the rest."""
        ...

    def remove(self, keys: Sequence[bytes]) -> None:
        """Delete blocks (leased ones are removed once their lease ends)."""
        ...

    def gc(self, now: float | None = None) -> int:
        """Expire blocks past their retention and abandoned reservations; return how many."""
        ...

    def stats(self) -> dict:
        """Counters: blocks, bytes, hits, misses, ... (names are the backend's)."""
        ...

    def close(self) -> None:
        ...


KVStoreFactory = Callable[[KVStoreConfig], KVStore]

"""Conformance suite for KV storage backends (``deepinfer_register_kv_stores``).

A backend's tests subclass :class:`KVStoreSuite` and override the ``make_store`` fixture::

    class TestMyStore(KVStoreSuite):
        persistent = True                     # records survive close() + reopen

        @pytest.fixture
        def make_store(self, store_path):
            return lambda config: MyStore(config)

        def corrupt(self, store, key, how):   # only backends that persist records
            ...                               # flip a payload byte / truncate the record

Configs handed to ``make_store`` carry ``path=store_path`` (a fresh temporary directory per
test); two stores opened in one test share it, as two processes sharing a disk would.
Every test checks an outcome that a broken backend would get wrong; none measures time
(expiry is driven through ``gc(now=...)``).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import pytest

from ..kv_store import RETENTION_SECONDS, KVStore, KVStoreConfig, KVStoreHolds, StaleTicketError

__all__ = ["DAY", "KVStoreSuite", "StoreFactory", "corrupt_record_file", "key"]


StoreFactory = Callable[[KVStoreConfig], KVStore]
DAY = 86400


def corrupt_record_file(path: str, how: str) -> None:
    """Damage a record file the way ``KVStoreSuite.corrupt`` asks: ``"flip"`` the last payload
    byte, or otherwise cut the record in half. For backends that keep one file per block."""
    with open(path, "r+b") as f:
        if how == "flip":
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        else:
            f.truncate(os.path.getsize(path) // 2)


def key(i: int) -> bytes:
    """A 16-byte key, like a chain hash."""
    return i.to_bytes(2, "big") * 8


class KVStoreSuite:
    block_bytes = 64
    namespace = "test-model/rev1/bf16/mla/128/rank0"
    persistent = False  # set True when records survive close() and reopening

    # -- fixtures and hooks a backend overrides ------------------------------------------------
    @pytest.fixture
    def store_path(self, tmp_path) -> str:
        return str(tmp_path / "kv")

    @pytest.fixture
    def make_store(self, store_path) -> StoreFactory:
        raise NotImplementedError("override the make_store fixture: return a (KVStoreConfig) -> KVStore callable")

    def corrupt(self, store: KVStore, key: bytes, how: str) -> None:
        """Damage ``key``'s committed record: ``how`` is ``"flip"`` (one payload byte) or
        ``"truncate"`` (cut the record short). Backends that persist records override this."""
        pytest.skip(f"{type(store).__name__} does not persist records")

    def reopen(self, store: KVStore, make_store: StoreFactory, config: KVStoreConfig) -> KVStore:
        """Close ``store`` and open it again, as a restarted process would."""
        if not self.persistent:
            pytest.skip(f"{type(store).__name__} is not persistent")
        store.close()
        return make_store(config)

    # -- helpers ---------------------------------------------------------------------------
    def config(self, store_path: str, **overrides) -> KVStoreConfig:
        fields = {"namespace": self.namespace, "block_bytes": self.block_bytes, "path": store_path, **overrides}
        return KVStoreConfig(**fields)

    @pytest.fixture
    def opened(self, make_store):
        """Open stores through the factory and close them after the test."""
        stores: list[KVStore] = []

        def open_store(config: KVStoreConfig) -> KVStore:
            store = make_store(config)
            stores.append(store)
            return store

        yield open_store
        for store in stores:
            store.close()

    @pytest.fixture
    def store(self, opened, store_path) -> KVStore:
        return opened(self.config(store_path))

    def payload(self, i: int) -> bytes:
        return bytes((i * 7 + j) % 251 for j in range(self.block_bytes))

    def put(self, store: KVStore, ids: list[int], retention: str = "chat") -> int:
        ticket = store.reserve_write([key(i) for i in ids], retention)
        by_key = {key(i): self.payload(i) for i in ids}
        store.write_from(ticket, [memoryview(by_key[k]) for k in ticket.keys])
        return store.commit(ticket, [True] * len(ticket.keys))

    def read(self, store: KVStore, ids: list[int]) -> list[bytes | None]:
        lease = store.acquire_read([key(i) for i in ids])
        try:
            buffers = [bytearray(self.block_bytes) for _ in ids]
            ok = store.read_into(lease, [memoryview(b) for b in buffers])
        finally:
            store.release(lease)
        return [bytes(b) if good else None for b, good in zip(buffers, ok)]

    def visible(self, store: KVStore, i: int) -> bool:
        return store.match_prefix([key(i)]) == 1

    # -- protocol ----------------------------------------------------------------------------
    def test_implements_protocol(self, store):
        assert isinstance(store, KVStore)
        assert isinstance(store.name, str) and store.name

    def test_stats_is_a_dict_counting_blocks(self, store):
        assert self.put(store, [1, 2]) == 2
        stats = store.stats()
        assert isinstance(stats, dict)
        assert stats["blocks"] == 2
        store.remove([key(1)])
        assert store.stats()["blocks"] == 1

    def test_wrong_buffer_size_is_rejected(self, store):
        ticket = store.reserve_write([key(1)])
        with pytest.raises(ValueError):
            store.write_from(ticket, [memoryview(bytes(self.block_bytes - 1))])

    def test_unknown_retention_is_rejected(self, store):
        with pytest.raises(ValueError):
            store.reserve_write([key(1)], retention="forever-and-ever")

    # -- visibility --------------------------------------------------------------------------
    def test_round_trip(self, store):
        assert self.put(store, [1, 2, 3]) == 3
        assert store.match_prefix([key(1), key(2), key(3)]) == 3
        assert self.read(store, [3, 1, 2]) == [self.payload(3), self.payload(1), self.payload(2)]

    def test_scatter_read_fills_pieces_back_to_back(self, store):
        """A store with ``scatter_reads`` fills a list of buffers per block as one payload
        (the engine's direct read into KV cache slices); a damaged record is still a miss."""
        if not getattr(store, "scatter_reads", False):
            pytest.skip(f"{store.name} takes one buffer per block")
        self.put(store, [1, 2])
        cuts = [0, 1, self.block_bytes // 3, self.block_bytes // 3, self.block_bytes]  # an empty piece too
        out = {i: [bytearray(b - a) for a, b in zip(cuts, cuts[1:])] for i in (1, 2)}
        lease = store.acquire_read([key(1), key(2), key(3)])
        try:
            with pytest.raises(ValueError):
                store.read_into(lease, [[memoryview(bytearray(1))]] * 3)  # pieces must add up to a block
            ok = store.read_into(
                lease,
                [
                    [memoryview(p) for p in out[1]],
                    [memoryview(p) for p in out[2]],
                    [memoryview(bytearray(self.block_bytes))],
                ],
            )
        finally:
            store.release(lease)
        assert ok == [True, True, False]
        assert [b"".join(out[i]) for i in (1, 2)] == [self.payload(1), self.payload(2)]
        if self.persistent:
            self.corrupt(store, key(2), "flip")
            lease = store.acquire_read([key(2)])
            try:
                assert store.read_into(lease, [[memoryview(p) for p in out[2]]]) == [False]
            finally:
                store.release(lease)

    def test_read_of_missing_key_is_false(self, store):
        self.put(store, [1])
        assert self.read(store, [1, 9]) == [self.payload(1), None]

    def test_visible_only_after_commit(self, store):
        ticket = store.reserve_write([key(1)])
        store.write_from(ticket, [memoryview(self.payload(1))])
        assert store.match_prefix([key(1)]) == 0
        assert self.read(store, [1]) == [None]
        assert store.commit(ticket, [True]) == 1
        assert self.read(store, [1]) == [self.payload(1)]

    def test_ok_mask_false_is_not_visible(self, store):
        ticket = store.reserve_write([key(1), key(2), key(3)])
        store.write_from(ticket, [memoryview(self.payload(i)) for i in (1, 2, 3)])
        assert store.commit(ticket, [True, False, True]) == 2
        assert store.match_prefix([key(1), key(2), key(3)]) == 1
        assert self.visible(store, 3) and not self.visible(store, 2)
        assert self.read(store, [2]) == [None]

    def test_unwritten_block_is_not_visible_even_if_ok(self, store):
        ticket = store.reserve_write([key(1)])
        assert store.commit(ticket, [True]) == 0
        assert not self.visible(store, 1)

    def test_reserve_skips_committed_keys(self, store):
        self.put(store, [1])
        ticket = store.reserve_write([key(1), key(2)])
        assert ticket.keys == (key(2),)

    def test_match_prefix_counts_leading_committed_keys_only(self, store):
        self.put(store, [0, 1, 3])
        assert store.match_prefix([key(0), key(1), key(2), key(3)]) == 2
        assert store.match_prefix([key(2), key(0)]) == 0
        assert store.match_prefix([]) == 0

    def test_namespaces_are_isolated(self, opened, store_path):
        first = opened(self.config(store_path, namespace="model-a/bf16"))
        second = opened(self.config(store_path, namespace="model-a/fp8"))
        self.put(first, [1])
        assert not self.visible(second, 1)
        assert self.read(second, [1]) == [None]
        assert self.read(first, [1]) == [self.payload(1)]

    def test_committed_ticket_is_stale(self, store):
        ticket = store.reserve_write([key(1)])
        store.write_from(ticket, [memoryview(self.payload(1))])
        store.commit(ticket, [True])
        with pytest.raises(StaleTicketError):
            store.commit(ticket, [True])

    # -- leases, eviction, removal --------------------------------------------------------------
    def test_eviction_is_least_recently_used(self, opened, store_path):
        store = opened(self.config(store_path, capacity_blocks=2))
        self.put(store, [1])
        self.put(store, [2])
        assert self.read(store, [1]) == [self.payload(1)]  # 1 is now more recent than 2
        self.put(store, [3])
        assert [self.visible(store, i) for i in (1, 2, 3)] == [True, False, True]

    def test_leased_block_is_not_evicted(self, opened, store_path):
        store = opened(self.config(store_path, capacity_blocks=2))
        self.put(store, [1])
        lease = store.acquire_read([key(1)])
        self.put(store, [2])
        self.put(store, [3])  # over capacity: 2 goes, 1 is pinned
        buffer = bytearray(self.block_bytes)
        assert store.read_into(lease, [memoryview(buffer)]) == [True]
        assert bytes(buffer) == self.payload(1)
        assert [self.visible(store, i) for i in (1, 2, 3)] == [True, False, True]
        store.release(lease)
        self.put(store, [4])  # now 1 is the least recently used unpinned block
        assert [self.visible(store, i) for i in (1, 3, 4)] == [False, True, True]

    def test_remove_of_leased_block_waits_for_release(self, store):
        self.put(store, [1, 2])
        lease = store.acquire_read([key(1)])
        store.remove([key(1), key(2)])
        assert not self.visible(store, 1) and not self.visible(store, 2)
        buffer = bytearray(self.block_bytes)
        assert store.read_into(lease, [memoryview(buffer)]) == [True]
        assert bytes(buffer) == self.payload(1)
        store.release(lease)
        assert not self.visible(store, 1)
        assert self.read(store, [1]) == [None]

    # -- expiry ------------------------------------------------------------------------------
    def test_abandoned_reservation_expires(self, store):
        ticket = store.reserve_write([key(1)])
        store.write_from(ticket, [memoryview(self.payload(1))])
        assert store.gc(now=ticket.expires_at + 1) >= 1
        with pytest.raises(StaleTicketError):
            store.commit(ticket, [True])
        with pytest.raises(StaleTicketError):
            store.write_from(ticket, [memoryview(self.payload(1))])
        assert not self.visible(store, 1)

    def test_retention_expiry(self, store):
        start = time.time()
        self.put(store, [1], retention="agent")
        self.put(store, [2], retention="chat")
        store.gc(now=start + RETENTION_SECONDS["agent"] - 60)
        assert self.visible(store, 1) and self.visible(store, 2)
        # Backends may round expiry up to a day bucket, never down.
        assert store.gc(now=start + RETENTION_SECONDS["agent"] + DAY + 60) >= 1
        assert not self.visible(store, 1) and self.visible(store, 2)
        assert self.read(store, [1, 2]) == [None, self.payload(2)]
        store.gc(now=start + RETENTION_SECONDS["chat"] + DAY + 60)
        assert not self.visible(store, 2)

    def test_leased_block_outlives_expiry_until_release(self, store):
        start = time.time()
        self.put(store, [1], retention="agent")
        lease = store.acquire_read([key(1)])
        store.gc(now=start + RETENTION_SECONDS["chat"] + 2 * DAY)
        buffer = bytearray(self.block_bytes)
        assert store.read_into(lease, [memoryview(buffer)]) == [True]
        assert bytes(buffer) == self.payload(1)
        store.release(lease)
        assert not self.visible(store, 1)

    # -- holds (optional: a store without them is skipped) -----------------------------------
    def holding(self, store: KVStore) -> KVStoreHolds:
        if not isinstance(store, KVStoreHolds):
            pytest.skip(f"{type(store).__name__} has no holds (hold / release_hold): retention alone keeps blocks")
        return store

    def test_hold_covers_live_blocks_only(self, store):
        holds = self.holding(store)
        self.put(store, [1, 2])
        hold = holds.hold([key(1), key(3), key(2)], 60)
        assert hold.keys == (key(1), key(2)) and hold.expires_at > time.time()
        holds.release_hold(hold)
        holds.release_hold(hold)  # idempotent

    def test_held_block_outlives_expiry_until_the_hold_ends(self, store):
        holds = self.holding(store)
        start = time.time()
        self.put(store, [1, 2], retention="agent")
        hold = holds.hold([key(1)], 10 * DAY)
        past_retention = start + RETENTION_SECONDS["agent"] + DAY + 60
        store.gc(now=past_retention)
        assert self.visible(store, 1) and not self.visible(store, 2)
        assert self.read(store, [1]) == [self.payload(1)]
        store.gc(now=hold.expires_at + 1)  # the hold ran out: expired like any block
        assert not self.visible(store, 1)

    def test_released_hold_frees_the_block_at_once(self, store):
        holds = self.holding(store)
        start = time.time()
        self.put(store, [1], retention="agent")
        hold = holds.hold([key(1)], 10 * DAY)
        holds.release_hold(hold)
        store.gc(now=start + RETENTION_SECONDS["agent"] + DAY + 60)
        assert not self.visible(store, 1)

    def test_hold_is_honoured_and_released_by_another_store_on_the_same_path(self, opened, store_path):
        if not self.persistent:
            pytest.skip("holds of a store that does not persist live in its process")
        writer = opened(self.config(store_path))
        holds = self.holding(writer)
        start = time.time()
        self.put(writer, [1, 2], retention="agent")
        hold = holds.hold([key(1), key(2)], 10 * DAY)
        reader = opened(self.config(store_path))  # another process sharing the store
        reader.gc(now=start + RETENTION_SECONDS["agent"] + DAY + 60)
        assert reader.match_prefix([key(1), key(2)]) == 2
        assert self.read(reader, [1, 2]) == [self.payload(1), self.payload(2)]
        self.holding(reader).release_hold(hold)
        reader.gc(now=start + RETENTION_SECONDS["agent"] + DAY + 60)
        assert reader.match_prefix([key(1)]) == 0
        assert self.read(writer, [1]) == [None]  # the file went: a miss in every process

    # -- concurrency -------------------------------------------------------------------------
    def test_concurrent_writers_of_one_key(self, store):
        first = store.reserve_write([key(1)])
        second = store.reserve_write([key(1)])
        tickets = [t for t in (first, second) if t.keys]
        assert tickets, "neither writer got the key"
        datas = [bytes([0xA0 + n]) * self.block_bytes for n in range(len(tickets))]
        for ticket, data in zip(tickets, datas):
            store.write_from(ticket, [memoryview(data)])
        made = [store.commit(t, [True]) for t in reversed(tickets)]
        assert sum(made) == 1  # one wins
        lease = store.acquire_read([key(1)])
        buffer = bytearray(self.block_bytes)
        assert store.read_into(lease, [memoryview(buffer)]) == [True]
        store.release(lease)
        assert bytes(buffer) in datas  # intact: one writer's bytes, never a mix
        assert store.stats()["blocks"] == 1

    # -- persistence -------------------------------------------------------------------------
    def test_corrupted_record_is_a_miss_and_removed(self, store):
        self.put(store, [1, 2])
        self.corrupt(store, key(1), "flip")
        assert self.read(store, [1, 2]) == [None, self.payload(2)]
        assert not self.visible(store, 1)

    def test_truncated_record_is_a_miss_and_removed(self, store):
        self.put(store, [1])
        self.corrupt(store, key(1), "truncate")
        assert self.read(store, [1]) == [None]
        assert not self.visible(store, 1)

    def test_survives_restart(self, make_store, store_path):
        config = self.config(store_path)
        store = make_store(config)
        self.put(store, [1, 2])
        store = self.reopen(store, make_store, config)
        try:
            assert store.match_prefix([key(1), key(2), key(3)]) == 2
            assert self.read(store, [1, 2]) == [self.payload(1), self.payload(2)]
        finally:
            store.close()

"""Holds on stored KV blocks (``KVStoreHolds``), the store side of the cluster's prefill ->
decode lease, on the real clock: a ``local`` store with a one-second retention, opened twice on
one directory as a prefill and a decode process share it. The conformance suite checks the same
rules through ``gc(now=...)`` for every backend; here the lookups' own clock runs out."""

from __future__ import annotations

import os
import time

import pytest

from deepinfer_core.kv_store import KVHold, KVStoreConfig, KVStoreHolds
from deepinfer_core.kv_store.local import LocalDiskKVStore
from deepinfer_core.kv_store.memory import MemoryKVStore

BLOCK = 64
RETENTION = 1.0


def key(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


def payload(i: int) -> bytes:
    return bytes((i * 5 + j) % 251 for j in range(BLOCK))


def open_local(root, retention: float = RETENTION) -> LocalDiskKVStore:
    options = {"retention_seconds": f"chat:{retention}"}
    return LocalDiskKVStore(KVStoreConfig(namespace="ns", block_bytes=BLOCK, path=str(root), options=options))


def put(store, ids) -> None:
    ticket = store.reserve_write([key(i) for i in ids])
    by_key = {key(i): payload(i) for i in ids}
    store.write_from(ticket, [memoryview(by_key[k]) for k in ticket.keys])
    assert store.commit(ticket, [True] * len(ticket.keys)) == len(ticket.keys)


def read(store, ids) -> list[bytes | None]:
    lease = store.acquire_read([key(i) for i in ids])
    try:
        buffers = [bytearray(BLOCK) for _ in ids]
        ok = store.read_into(lease, [memoryview(b) for b in buffers])
    finally:
        store.release(lease)
    return [bytes(b) if good else None for b, good in zip(buffers, ok)]


def records(root) -> list[str]:
    return sorted(f for _, _, fs in os.walk(root) for f in fs if f.endswith(".kv"))


def hold_files(root) -> list[str]:
    return sorted(f for _, _, fs in os.walk(root) for f in fs if f.endswith(".hold"))


def test_a_held_block_outlives_its_retention_in_every_process_until_released(tmp_path):
    prefill = open_local(tmp_path)
    put(prefill, [1, 2, 3])
    hold = prefill.hold([key(1), key(2), key(9)], 30)  # key 9 was never written: not held
    assert hold.keys == (key(1), key(2)) and hold_files(tmp_path) == [f"{hold.hold_id}.hold"]
    time.sleep(RETENTION + 0.2)
    decode = open_local(tmp_path)  # a fresh process: nothing in its index yet
    assert decode.match_prefix([key(1), key(2), key(3)]) == 2  # block 3 expired, unheld
    assert read(decode, [1, 2, 3]) == [payload(1), payload(2), None]
    assert prefill.match_prefix([key(1), key(2)]) == 2  # the taker's own index honours it too
    decode.gc()
    prefill.gc()
    assert records(tmp_path) == sorted(f"{key(i).hex()}.kv" for i in (1, 2))  # only the held survive gc
    decode.release_hold(hold)  # the reader releases the writer's hold
    assert hold_files(tmp_path) == [] and decode.match_prefix([key(1)]) == 0
    assert decode.gc() == 2 and records(tmp_path) == []
    assert read(prefill, [1]) == [None]  # gone for its taker too: a miss, never stale bytes
    assert prefill.stats()["holds"] == 1 and decode.stats()["holds_released"] == 1


def test_an_expired_hold_is_not_honoured_and_gc_removes_it(tmp_path):
    store = open_local(tmp_path, retention=0.5)
    put(store, [1])
    store.hold([key(1)], 0.8)
    time.sleep(1.0)  # past the retention and the hold
    assert store.match_prefix([key(1)]) == 0 and read(open_local(tmp_path, 0.5), [1]) == [None]
    assert store.gc() == 1 and records(tmp_path) == [] and hold_files(tmp_path) == []
    assert store.stats()["holds_expired"] == 1


def test_a_block_expiring_during_a_read_is_served_while_its_hold_runs(tmp_path):
    """The reader found the block live (before its retention ended), reads it after: the hold
    keeps the read valid. Without the hold the same read is a miss (recompute), never data."""
    store = open_local(tmp_path)
    put(store, [1, 2])
    store.hold([key(1)], 30)
    lease = store.acquire_read([key(1), key(2)])
    time.sleep(RETENTION + 0.2)
    buffers = [bytearray(BLOCK), bytearray(BLOCK)]
    assert store.read_into(lease, [memoryview(b) for b in buffers]) == [True, False]
    store.release(lease)
    assert bytes(buffers[0]) == payload(1)


def test_a_rewrite_of_an_expired_held_block_keeps_the_held_file_for_its_readers(tmp_path):
    store = open_local(tmp_path)
    put(store, [1])
    hold = store.hold([key(1)], 30)
    reader = open_local(tmp_path)
    assert reader.match_prefix([key(1)]) == 1  # indexed at the held path
    time.sleep(RETENTION + 0.2)
    put(store, [1])  # written again after its retention: a fresh record
    assert read(reader, [1]) == [payload(1)]
    store.release_hold(hold)
    assert read(open_local(tmp_path), [1]) == [payload(1)]  # the rewritten record, live


def test_hold_files_that_are_not_ours_are_ignored(tmp_path):
    store = open_local(tmp_path)
    put(store, [1])
    holds = tmp_path / next(d for d in os.listdir(tmp_path)) / "holds"
    holds.mkdir(exist_ok=True)
    (holds / "junk.hold").write_text("{not json")
    outside = tmp_path / "outside.hold"
    outside.write_text("x")
    store.release_hold(KVHold("../../outside", (key(1),), time.time() + 30))  # an id that names a path
    assert outside.exists() and store.match_prefix([key(1)]) == 1
    time.sleep(RETENTION + 0.2)
    assert store.match_prefix([key(1)]) == 0  # a file that does not parse holds nothing
    store.gc()
    assert not (holds / "junk.hold").exists() and records(tmp_path) == []


def test_bad_hold_seconds_are_refused(tmp_path):
    for store in (open_local(tmp_path), MemoryKVStore(KVStoreConfig(namespace="ns", block_bytes=BLOCK))):
        for seconds in (0, -1, float("inf"), True):
            with pytest.raises(ValueError, match="seconds"):
                store.hold([key(1)], seconds)


def test_the_builtin_stores_declare_holds():
    assert isinstance(MemoryKVStore(KVStoreConfig(namespace="ns", block_bytes=BLOCK)), KVStoreHolds)
    assert issubclass(LocalDiskKVStore, KVStoreHolds)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_capacity_eviction_takes_a_held_block_by_its_use_not_first_as_expired(tmp_path, backend):
    options = {"retention_seconds": "chat:0.3"}
    config = KVStoreConfig(namespace="ns", block_bytes=BLOCK, path=str(tmp_path), capacity_blocks=2, options=options)
    store = MemoryKVStore(config) if backend == "memory" else LocalDiskKVStore(config)
    put(store, [1])  # chat: 0.3 s
    store.hold([key(1)], 30)
    ticket = store.reserve_write([key(2)], "agent")
    store.write_from(ticket, [memoryview(payload(2))])
    store.commit(ticket, [True])
    time.sleep(0.4)  # block 1 past its retention, held
    assert read(store, [1]) == [payload(1)]  # block 1 is now the most recently used
    ticket = store.reserve_write([key(3)], "agent")
    store.write_from(ticket, [memoryview(payload(3))])
    store.commit(ticket, [True])  # over capacity: the least recently used goes
    assert [store.match_prefix([key(i)]) for i in (1, 2, 3)] == [1, 0, 1]

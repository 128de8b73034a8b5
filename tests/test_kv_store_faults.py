"""Fault cases on the file-backed KV store beyond tests/test_kv_store_hardening.py: symlinks
planted in the tree, records moved to another key's or namespace's path, headers that pass
their checksum but disagree with the block, the clock moving backwards, and an operator's
``kv gc`` running while an engine writes.

The rule each keeps: never wrong bytes (a miss instead), never a path outside the root read,
written or deleted, and the key can be written again.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from deepinfer_core.kv_store import KVStoreConfig
from deepinfer_core.kv_store.local import LocalDiskKVStore
from deepinfer_core.kv_store.records import encode_header, namespace_fingerprint, record_filename
from deepinfer_core.testing.kv_store import KVStoreSuite, key


class _Disk(KVStoreSuite):
    """The conformance suite's helpers (config, put, read)."""


disk = _Disk()


def open_local(path, **overrides) -> LocalDiskKVStore:
    return LocalDiskKVStore(disk.config(str(path), **overrides))


def snapshot(path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``path``: (size, mtime_ns, bytes); proves nothing there changed."""
    out = {}
    for d, _, fs in os.walk(path):
        for f in fs:
            p = os.path.join(d, f)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns, open(p, "rb").read())
    return out


@pytest.fixture
def outside(tmp_path):
    """A directory beside the store root holding a valid record of key 1 (another store's)
    and junk named like records: what a planted symlink points at."""
    other = open_local(tmp_path / "elsewhere")
    disk.put(other, [1])
    path = other.record_path(key(1))
    junk = os.path.join(os.path.dirname(path), record_filename(key(9)))
    with open(junk, "wb") as f:
        f.write(b"not a record")
    old = time.time() - 30 * 86400  # looks like a long-expired temp file / record
    os.utime(junk, (old, old))
    return tmp_path / "elsewhere", path


def test_a_record_replaced_by_a_symlink_is_a_miss_and_the_target_is_untouched(tmp_path, outside):
    root, target = outside
    before = snapshot(root)
    store = open_local(tmp_path / "kv")
    disk.put(store, [1])
    path = store.record_path(key(1))
    os.unlink(path)
    os.symlink(target, path)  # a valid record of the same key, outside the root
    fresh = open_local(tmp_path / "kv")
    assert disk.read(store, [1]) == [None] and disk.read(fresh, [1]) == [None]
    assert fresh.match_prefix([key(1)]) == 0
    assert disk.put(store, [1]) == 1 and disk.read(store, [1]) == [disk.payload(1)]
    assert not os.path.islink(store.record_path(key(1)))
    store.gc(now=time.time() + 400 * 86400)
    open_local(tmp_path / "kv").gc()
    assert snapshot(root) == before


@pytest.mark.parametrize("level", ["retention", "day", "prefix"])
def test_a_directory_symlink_in_the_tree_is_never_followed(tmp_path, outside, level):
    """A symlinked directory (retention class, day bucket or key-prefix level) pointing
    outside: the scan at open, lookups, writes and gc neither use nor change what is there."""
    root, _ = outside
    before = snapshot(root)
    store = open_local(tmp_path / "kv")
    disk.put(store, [1])
    record = store.record_path(key(1))
    link = {"retention": 3, "day": 2, "prefix": 1}[level]
    planted = record
    for _ in range(link):
        planted = os.path.dirname(planted)
    shutil.rmtree(planted)
    target = os.path.dirname(outside[1])
    for _ in range(link - 1):
        target = os.path.dirname(target)
    os.symlink(target, planted)
    fresh = open_local(tmp_path / "kv")
    assert fresh.match_prefix([key(1)]) == 0 and disk.read(fresh, [1]) == [None]
    assert disk.read(store, [1]) == [None]
    disk.put(fresh, [1, 2])
    assert disk.read(fresh, [1, 2]) == [disk.payload(1), disk.payload(2)]
    fresh.gc(now=time.time() + 400 * 86400)
    open_local(tmp_path / "kv").gc()
    assert snapshot(root) == before


def _plant(store: LocalDiskKVStore, at_key: bytes, record: bytes) -> None:
    path = store.record_path(at_key)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(record)


def _record(namespace: str, k: bytes, payload: bytes, expires_at: float | None = None) -> bytes:
    expires = time.time() + 3600 if expires_at is None else expires_at
    return encode_header(namespace_fingerprint(namespace), k, memoryview(payload), expires) + payload


@pytest.mark.parametrize("case", ["other key", "other namespace", "short payload header", "long payload header"])
def test_a_well_formed_record_that_is_not_this_block_is_a_miss(tmp_path, case):
    """Valid checksums all: the header names another key or namespace, or a payload length
    other than the block's (the file padded or cut to the expected size)."""
    store = open_local(tmp_path)
    disk.put(store, [1, 2])
    size = os.path.getsize(store.record_path(key(1)))
    if case == "other key":
        record = _record(disk.namespace, key(2), disk.payload(2))
    elif case == "other namespace":
        record = _record(disk.namespace + "-fp16", key(1), disk.payload(3))
    elif case == "short payload header":
        record = _record(disk.namespace, key(1), disk.payload(3)[:-8]) + bytes(8)
    else:
        record = _record(disk.namespace, key(1), disk.payload(3) + bytes(8))[:size]
    assert len(record) == size
    _plant(store, key(1), record)
    for reader in (store, open_local(tmp_path)):
        assert reader.match_prefix([key(1)]) in (0, 1)  # metadata only; the read decides
        assert disk.read(reader, [1]) == [None]
    assert disk.put(store, [1]) == 1 and disk.read(store, [1]) == [disk.payload(1)]


def test_clock_moved_backwards_keeps_serving_the_right_bytes(tmp_path, monkeypatch):
    """Records written while the clock ran two days ahead: after it is set back they stay
    served (they expire later, never early), are not collected as expired, and new writes
    and reads work; once the clock passes their retention they are misses."""
    import deepinfer_core.kv_store.local as local_mod
    import deepinfer_core.kv_store.records as records_mod

    real = time.time
    skew = [2 * 86400.0]

    class Clock:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def time():
            return real() + skew[0]

    monkeypatch.setattr(local_mod, "time", Clock())
    monkeypatch.setattr(records_mod, "time", Clock())
    options = {"retention_seconds": {"chat": 1.5 * 86400}}
    store = open_local(tmp_path, options=options)
    disk.put(store, [1, 2])
    skew[0] = 0.0  # the clock is set back two days
    for reader in (store, open_local(tmp_path, options=options)):
        assert reader.gc() == 0
        assert disk.read(reader, [1, 2]) == [disk.payload(1), disk.payload(2)]
        assert disk.put(reader, [3]) in (0, 1)
        assert disk.read(reader, [3]) == [disk.payload(3)]
    skew[0] = 86400.0  # key 3 (1.5 days) and keys 1, 2 (3.5 days from now - 2) all live
    assert disk.read(open_local(tmp_path, options=options), [1, 2, 3]) == [disk.payload(i) for i in (1, 2, 3)]
    skew[0] = 4 * 86400.0  # past every record's retention
    assert disk.read(store, [1, 2, 3]) == [None, None, None]
    assert disk.read(open_local(tmp_path, options=options), [1, 2, 3]) == [None, None, None]


def test_kv_gc_racing_a_writer(tmp_path):
    """An operator's gc (another store on the same directory, as ``deepinfer kv gc`` is)
    running in a loop while a writer commits and reads: every committed block reads back
    intact, nothing raises."""
    writer = open_local(tmp_path)
    operator = open_local(tmp_path)
    stop = threading.Event()
    errors: list[BaseException] = []

    def collect():
        try:
            while not stop.is_set():
                operator.gc()
                LocalDiskKVStore(operator.config).gc()  # a fresh process's gc too
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=collect)
    thread.start()
    try:
        for i in range(1, 120):
            assert disk.put(writer, [i]) == 1
            assert disk.read(writer, [i]) == [disk.payload(i)]
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert disk.read(open_local(tmp_path), list(range(1, 120))) == [disk.payload(i) for i in range(1, 120)]


def test_two_namespaces_of_different_block_sizes_share_a_root(tmp_path):
    """Two models (another dtype: another block size) in one root: each sees only its own
    records, a fresh open of either drops nothing of the other, gc of one leaves the other."""
    a = open_local(tmp_path)
    b = LocalDiskKVStore(
        KVStoreConfig(namespace=disk.namespace + "/fp16", block_bytes=disk.block_bytes // 2, path=str(tmp_path))
    )
    disk.put(a, [1, 2])
    ticket = b.reserve_write([key(1)])
    b.write_from(ticket, [memoryview(disk.payload(5)[: disk.block_bytes // 2])])
    assert b.commit(ticket, [True]) == 1
    b.gc(now=time.time() + 30 * 86400)  # everything of b's expired; a's untouched
    a2 = open_local(tmp_path)
    assert disk.read(a2, [1, 2]) == [disk.payload(1), disk.payload(2)]
    b2 = LocalDiskKVStore(b.config)
    lease = b2.acquire_read([key(1)])
    buf = bytearray(disk.block_bytes // 2)
    assert b2.read_into(lease, [memoryview(buf)]) == [False]
    b2.release(lease)

"""The builtin KV stores against the conformance suite, plus what only the disk store does."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from deepinfer_core.kv_store import KVStoreConfig
from deepinfer_core.kv_store.local import LocalDiskKVStore
from deepinfer_core.kv_store.memory import MemoryKVStore
from deepinfer_core.kv_store.records import PosixRecordIO
from deepinfer_core.plugin_host import PluginHost
from deepinfer_core.testing.kv_store import KVStoreSuite, corrupt_record_file, key


class TestMemoryKVStore(KVStoreSuite):
    @pytest.fixture
    def make_store(self, store_path):
        return MemoryKVStore


class TestLocalDiskKVStore(KVStoreSuite):
    persistent = True

    @pytest.fixture
    def make_store(self, store_path):
        return LocalDiskKVStore

    def corrupt(self, store, key, how):
        path = store.record_path(key)
        assert path is not None and os.path.exists(path)
        corrupt_record_file(path, how)


def test_builtin_catalogue_registers_memory_and_local():
    stores = PluginHost(load_entry_points=False).kv_stores()
    assert stores["memory"] is MemoryKVStore
    assert stores["local"] is LocalDiskKVStore


# -- local-only behaviour -------------------------------------------------------------------------
class _Disk(KVStoreSuite):
    """Reuses the suite's helpers (config, put, read) for the tests below."""


disk = _Disk()


def open_local(path, **overrides) -> LocalDiskKVStore:
    return LocalDiskKVStore(disk.config(str(path), **overrides))


def test_restart_rebuilds_index_from_disk(tmp_path):
    store = open_local(tmp_path)
    disk.put(store, [1, 2, 3])
    store.close()
    reopened = open_local(tmp_path)
    # The scan on open found all three, before any lookup touched the disk.
    assert reopened.stats()["blocks"] == 3
    assert disk.read(reopened, [1, 2, 3]) == [disk.payload(i) for i in (1, 2, 3)]


def test_restart_applies_capacity_and_drops_truncated_records(tmp_path):
    store = open_local(tmp_path)
    disk.put(store, [1, 2, 3])
    truncated = store.record_path(key(3))
    store.close()
    corrupt_record_file(truncated, "truncate")
    reopened = open_local(tmp_path, capacity_blocks=1)
    assert not os.path.exists(truncated)
    assert reopened.stats()["dropped_at_scan"] == 1
    assert reopened.stats()["blocks"] == 1


def test_default_path_is_under_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    store = LocalDiskKVStore(KVStoreConfig(namespace="ns", block_bytes=disk.block_bytes))
    disk.put(store, [1])
    assert store.record_path(key(1)).startswith(str(tmp_path / ".cache" / "deepinfer" / "kv"))


def test_record_of_another_namespace_is_not_returned(tmp_path):
    mine = open_local(tmp_path, namespace="model/bf16")
    theirs = open_local(tmp_path, namespace="model/fp8")
    disk.put(mine, [1])
    disk.put(theirs, [2])
    # Put their record for key 2 where my record for key 2 would be (a misplaced file).
    disk.put(mine, [2])
    my_path = mine.record_path(key(2))
    shutil.copyfile(theirs.record_path(key(2)), my_path)
    assert disk.read(mine, [2]) == [None]
    assert not os.path.exists(my_path)
    assert mine.match_prefix([key(1), key(2)]) == 1
    assert disk.read(theirs, [2]) == [disk.payload(2)]


class _FailingIO(PosixRecordIO):
    """Writes half a record, then fails as a full disk would."""

    def write_file(self, path, parts):
        data = b"".join(bytes(p) for p in parts)
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", path)


def test_failed_disk_write_leaves_no_partial_record(tmp_path):
    store = LocalDiskKVStore(disk.config(str(tmp_path)), io=_FailingIO())
    ticket = store.reserve_write([key(1)])
    with pytest.raises(OSError):
        store.write_from(ticket, [memoryview(disk.payload(1))])
    assert store.commit(ticket, [True]) == 0
    assert store.match_prefix([key(1)]) == 0
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f != "namespace.json"]
    assert leftovers == []
    # A fresh process sees nothing either.
    assert open_local(tmp_path).match_prefix([key(1)]) == 0


def test_second_process_sees_commits_without_reopening(tmp_path):
    writer = open_local(tmp_path)
    reader = open_local(tmp_path)
    disk.put(writer, [1])
    assert reader.match_prefix([key(1)]) == 1
    assert disk.read(reader, [1]) == [disk.payload(1)]


def test_gc_sweeps_temp_files_of_dead_processes(tmp_path):
    store = open_local(tmp_path)
    orphan = os.path.join(store.stats()["path"], "tmp", f"{key(1).hex()}.99999.dead.1.tmp")
    with open(orphan, "wb") as f:
        f.write(b"half a record")
    live = store.reserve_write([key(2)])
    store.write_from(live, [memoryview(disk.payload(2))])
    assert store.gc(now=os.path.getmtime(orphan) + 60) == 0  # too young to be abandoned
    assert store.gc(now=os.path.getmtime(orphan) + 3600) >= 1
    assert not os.path.exists(orphan)


def test_gc_deletes_whole_expired_day_buckets(tmp_path):
    store = open_local(tmp_path)
    disk.put(store, [1], retention="agent")
    bucket = os.path.dirname(os.path.dirname(store.record_path(key(1))))
    store.gc(now=os.path.getmtime(store.record_path(key(1))) + 5 * 86400)
    assert not os.path.exists(bucket)


# -- counters across processes (issue 31.7: `deepinfer kv stats` showed hits=0 misses=0 after
# another process was served from the store) -----------------------------------------------------
def test_shared_stats_add_up_the_counters_of_every_process(tmp_path):
    writer, reader = open_local(tmp_path), open_local(tmp_path)  # two processes' stores (own files)
    disk.put(writer, [1, 2])
    assert disk.read(reader, [1, 2]) == [disk.payload(1), disk.payload(2)]
    assert disk.read(reader, [3]) == [None]  # absent: a miss
    reader.close()  # writes its last counts
    mine = writer.stats()
    assert (mine["hits"], mine["misses"], mine["commits"]) == (0, 0, 2)  # this process's own
    shared = writer.shared_stats()
    assert (shared["hits"], shared["misses"], shared["commits"], shared["processes"]) == (2, 1, 2, 2)
    assert shared["blocks"] == 2
    # an operator's process that only looks adds no file and changes no count
    assert open_local(tmp_path).shared_stats()["processes"] == 2


def test_counter_files_that_are_damaged_are_skipped_and_stale_ones_go_with_gc(tmp_path):
    store = open_local(tmp_path)
    disk.put(store, [1])
    counters = os.path.join(store.stats()["path"], "counters")
    with open(os.path.join(counters, "other.1.x.json"), "w") as f:
        f.write('{"hits": "many", "misses": -5, "commits": 3}')  # foreign values: only the count counts
    with open(os.path.join(counters, "broken.2.y.json"), "w") as f:
        f.write("{not json")
    with open(os.path.join(counters, "list.3.z.json"), "w") as f:
        f.write("[1, 2]")
    shared = store.shared_stats()
    assert (shared["hits"], shared["misses"], shared["commits"], shared["processes"]) == (0, 0, 4, 2)
    old = os.path.join(counters, "other.1.x.json")
    os.utime(old, (0, 0))  # untouched for decades: a process long gone
    store.gc()
    assert not os.path.exists(old) and store.shared_stats()["processes"] == 1

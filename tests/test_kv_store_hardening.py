"""Defects found by fault injection on the file-backed KV store, one test each.

The rule they all keep: whatever sits on disk, a store never returns wrong bytes, never
touches paths outside its root, never blocks, and a key it dropped can be written again.
"""

from __future__ import annotations

import errno
import os
import pathlib
import threading

import pytest

from deepinfer_core.kv_store.local import LocalDiskKVStore
from deepinfer_core.testing.kv_store import KVStoreSuite, key


class _Disk(KVStoreSuite):
    """The conformance suite's helpers (config, put, read)."""


disk = _Disk()


def open_local(path, **overrides) -> LocalDiskKVStore:
    return LocalDiskKVStore(disk.config(str(path), **overrides))


def files_under(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f != "namespace.json")


@pytest.mark.parametrize("name", ["../../outside", "/absolute", "a/b", "..", ""])
def test_retention_class_that_is_not_one_path_component_is_rejected(tmp_path, name):
    root = tmp_path / "root" / "kv"
    with pytest.raises(ValueError, match="retention_seconds"):
        open_local(root, options={"retention_seconds": {name: 60}})
    assert files_under(tmp_path) == []
    assert not (tmp_path / "outside").exists()


def test_retention_seconds_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"retention_seconds\['chat'\]"):
        open_local(tmp_path, options={"retention_seconds": {"chat": -1}})


def _read_with_timeout(store, ids, path, timeout=10.0):
    """``disk.read`` in a thread; a read stuck on a FIFO is unblocked by opening its writer."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(disk.read(store, ids)), daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # let the stuck open return
        worker.join(timeout)
        pytest.fail("read_into blocked on a FIFO at a record path")
    return result[0]


def test_fifo_at_a_record_path_is_a_miss_and_is_replaced(tmp_path):
    store = open_local(tmp_path)
    other = open_local(tmp_path)  # another process, opened before the FIFO appears
    disk.put(store, [1])
    path = store.record_path(key(1))
    os.unlink(path)
    os.mkfifo(path)
    assert other.match_prefix([key(1)]) == 0  # found on disk only: a FIFO is no record
    assert _read_with_timeout(store, [1], path) == [None]
    assert disk.put(store, [1]) == 1
    assert disk.read(store, [1]) == [disk.payload(1)]
    assert disk.read(open_local(tmp_path), [1]) == [disk.payload(1)]


def test_directory_at_a_record_path_is_a_miss_and_is_replaced(tmp_path):
    store = open_local(tmp_path)
    disk.put(store, [1])
    path = store.record_path(key(1))
    os.unlink(path)
    os.mkdir(path)
    (pathlib.Path(path) / "junk").write_bytes(b"x")
    assert open_local(tmp_path).match_prefix([key(1)]) == 0
    assert disk.read(store, [1]) == [None]  # not IsADirectoryError
    assert disk.put(store, [1]) == 1
    assert disk.read(store, [1]) == [disk.payload(1)]
    assert os.path.isfile(path)


def test_enospc_while_commit_creates_its_directory(tmp_path, monkeypatch):
    store = open_local(tmp_path)
    ticket = store.reserve_write([key(1), key(2)])
    store.write_from(ticket, [memoryview(disk.payload(i)) for i in (1, 2)])
    real_mkdir = pathlib.Path.mkdir

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(pathlib.Path, "mkdir", full_disk)
    assert store.commit(ticket, [True, True]) == 0  # dropped and counted, not raised
    monkeypatch.setattr(pathlib.Path, "mkdir", real_mkdir)
    assert store.stats()["commit_failures"] == 2
    assert files_under(tmp_path) == []  # no orphan temp file
    assert store.match_prefix([key(1)]) == 0
    assert disk.put(store, [1, 2]) == 2  # the disk has room again: the keys are writable
    assert disk.read(store, [1, 2]) == [disk.payload(1), disk.payload(2)]


def test_store_directory_deleted_under_a_running_store(tmp_path):
    import shutil

    store = open_local(tmp_path / "kv")
    disk.put(store, [1])
    shutil.rmtree(tmp_path / "kv")
    assert disk.read(store, [1]) == [None]
    assert store.match_prefix([key(1)]) == 0
    assert disk.put(store, [1, 2]) == 2  # recreates what it needs
    assert disk.read(open_local(tmp_path / "kv"), [1, 2]) == [disk.payload(1), disk.payload(2)]


@pytest.mark.parametrize("where", ["tmp", "namespace", "retention class"])
def test_a_file_where_the_store_expects_a_directory_is_replaced(tmp_path, where):
    """Issue 31.3: a regular file at ``<fp>/tmp`` made opening the store raise FileExistsError
    (and ``deepinfer serve`` die with a traceback); one at ``<fp>`` raised NotADirectoryError,
    one at a retention class's directory made every commit fail. The store's own layout is
    repaired: the stray file goes, and blocks are written and read back."""
    root = tmp_path / "kv"
    fp_dir = open_local(root)._dir
    for item in sorted(root.rglob("*"), reverse=True):
        item.rmdir() if item.is_dir() else item.unlink()
    stray = {"tmp": fp_dir / "tmp", "namespace": fp_dir, "retention class": fp_dir / "chat"}[where]
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_text("not a directory")
    store = open_local(root)
    assert disk.put(store, [1, 2]) == 2
    assert disk.read(store, [1, 2]) == [disk.payload(1), disk.payload(2)]
    assert stray.is_dir() and store.stats()["commit_failures"] == 0


def test_a_store_path_under_a_file_is_refused_with_one_line(tmp_path):
    """A root that cannot be a directory (a file there, or above it) is not the store's to
    repair: a ValueError naming the path, which the commands print as one error line."""
    (tmp_path / "file").write_text("mine")
    for root in (tmp_path / "file", tmp_path / "file" / "kv"):
        with pytest.raises(ValueError, match="is not a directory"):
            open_local(root)
    assert (tmp_path / "file").read_text() == "mine"

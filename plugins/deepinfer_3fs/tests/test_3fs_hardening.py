"""3fs-specific defects found by fault injection: paths from config, USRBIO short writes."""

from __future__ import annotations

import errno
import os

import pytest
from usrbio_mock import MockUsrbioClient

from deepinfer_3fs.store import ThreeFSConfigError, ThreeFSKVStore
from deepinfer_core.testing.kv_store import KVStoreSuite, key

suite = KVStoreSuite()


def files_under(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f != "namespace.json")


@pytest.mark.parametrize("subdir", ["../outside", "a/../../outside", "/abs/elsewhere", "", 7])
def test_subdir_must_stay_under_the_mount(tmp_path, subdir):
    mount = tmp_path / "mount"
    mount.mkdir()
    with pytest.raises(ThreeFSConfigError, match="subdir"):
        ThreeFSKVStore(suite.config(str(mount), options={"io": "posix", "subdir": subdir}))
    assert sorted(os.listdir(tmp_path)) == ["mount"] and os.listdir(mount) == []


def test_nested_relative_subdir_is_fine(tmp_path):
    store = ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "posix", "subdir": "team/kv"}))
    suite.put(store, [1])
    assert store.record_path(key(1)).startswith(str(tmp_path / "team" / "kv"))


def test_retention_class_outside_the_root_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="retention_seconds"):
        ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "posix", "retention_seconds": {"../../x": 1}}))


def test_usrbio_short_write_is_an_oserror_with_an_errno(tmp_path):
    client = MockUsrbioClient(str(tmp_path))
    store = ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "usrbio"}), usrbio=client)
    client.short_writes = True
    ticket = store.reserve_write([key(1)])
    with pytest.raises(OSError) as raised:
        store.write_from(ticket, [memoryview(suite.payload(1))])
    assert raised.value.errno == errno.EIO
    assert store.commit(ticket, [True]) == 0
    assert files_under(tmp_path) == []
    client.short_writes = False
    assert suite.put(store, [1]) == 1
    assert suite.read(store, [1]) == [suite.payload(1)]


def test_usrbio_read_of_a_fifo_is_a_miss(tmp_path):
    client = MockUsrbioClient(str(tmp_path))
    store = ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "usrbio"}), usrbio=client)
    suite.put(store, [1])
    path = store.record_path(key(1))
    os.unlink(path)
    os.mkfifo(path)
    assert suite.read(store, [1]) == [None]  # returns at once: the open does not block
    assert suite.put(store, [1]) == 1
    assert suite.read(store, [1]) == [suite.payload(1)]

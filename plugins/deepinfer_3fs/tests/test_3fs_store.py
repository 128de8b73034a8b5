"""The 3fs store against the core conformance suite (POSIX and mock USRBIO), plus 3FS specifics."""

from __future__ import annotations

import errno
import os

import pytest
from usrbio_mock import MockUsrbioClient

from deepinfer_3fs import store as store_module
from deepinfer_3fs.store import MOUNT_ENV, ThreeFSConfigError, ThreeFSKVStore
from deepinfer_core.kv_store import KVStoreConfig
from deepinfer_core.kv_store.local import LocalDiskKVStore
from deepinfer_core.testing.kv_store import KVStoreSuite, corrupt_record_file, key


class _ThreeFSSuite(KVStoreSuite):
    persistent = True

    def corrupt(self, store, key, how):
        path = store.record_path(key)
        assert path is not None and path.startswith(store.mount)
        corrupt_record_file(path, how)


class TestThreeFSPosix(_ThreeFSSuite):
    @pytest.fixture
    def make_store(self, store_path):
        os.makedirs(store_path, exist_ok=True)

        def make(config):
            store = ThreeFSKVStore(dataclass_with(config, io="posix"))
            assert store.io_kind == "posix"
            return store

        return make


class TestThreeFSUsrbio(_ThreeFSSuite):
    @pytest.fixture
    def client(self, store_path):
        return MockUsrbioClient(store_path)

    @pytest.fixture
    def make_store(self, store_path, client):
        os.makedirs(store_path, exist_ok=True)
        return lambda config: ThreeFSKVStore(dataclass_with(config, io="usrbio"), usrbio=client)

    def test_data_goes_through_usrbio(self, store, client):
        assert store.stats()["io"] == "usrbio"
        self.put(store, [1])
        assert self.read(store, [1]) == [self.payload(1)]
        assert client.ops["write"] == 1 and client.ops["read"] == 2  # header, then payload
        assert client.registered == set()  # every fd deregistered

    def test_usrbio_read_error_is_a_miss(self, store, client):
        self.put(store, [1])
        client.fail_with = errno.EIO
        assert self.read(store, [1]) == [None]

    def test_usrbio_write_error_leaves_nothing(self, store, client, store_path):
        client.fail_with = errno.ENOSPC
        ticket = store.reserve_write([key(1)])
        with pytest.raises(OSError):
            store.write_from(ticket, [memoryview(self.payload(1))])
        assert store.commit(ticket, [True]) == 0
        assert [f for _, _, files in os.walk(store_path) for f in files if f != "namespace.json"] == []


def dataclass_with(config: KVStoreConfig, **options) -> KVStoreConfig:
    return KVStoreConfig(
        config.namespace, config.block_bytes, config.path, config.capacity_blocks, {**config.options, **options}
    )


# -- 3FS specifics --------------------------------------------------------------------------------
suite = KVStoreSuite()


def test_no_mount_configured_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(MOUNT_ENV, raising=False)
    with pytest.raises(ThreeFSConfigError, match="no 3FS mount configured"):
        ThreeFSKVStore(KVStoreConfig("ns", 64))


def test_missing_mount_is_a_clear_error(tmp_path):
    with pytest.raises(ThreeFSConfigError, match=f"3FS mount {tmp_path / 'absent'} does not exist"):
        ThreeFSKVStore(KVStoreConfig("ns", 64, path=str(tmp_path / "absent")))


def test_mount_from_environment_and_option(tmp_path, monkeypatch):
    (tmp_path / "env").mkdir()
    (tmp_path / "opt").mkdir()
    monkeypatch.setenv(MOUNT_ENV, str(tmp_path / "env"))
    from_env = ThreeFSKVStore(KVStoreConfig("ns", 64, options={"io": "posix"}))
    assert from_env.mount == str(tmp_path / "env")
    from_option = ThreeFSKVStore(KVStoreConfig("ns", 64, options={"io": "posix", "path": str(tmp_path / "opt")}))
    suite.put(from_option, [1])
    assert from_option.record_path(key(1)).startswith(str(tmp_path / "opt" / "deepinfer-kv"))


def test_io_choice_without_usrbio(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "load_usrbio", lambda: None)
    assert ThreeFSKVStore(KVStoreConfig("ns", 64, path=str(tmp_path))).io_kind == "posix"
    with pytest.raises(ThreeFSConfigError, match="not importable"):
        ThreeFSKVStore(KVStoreConfig("ns", 64, path=str(tmp_path), options={"io": "usrbio"}))
    with pytest.raises(ThreeFSConfigError, match="unknown io"):
        ThreeFSKVStore(KVStoreConfig("ns", 64, path=str(tmp_path), options={"io": "rdma"}))


def test_auto_picks_usrbio_when_present(tmp_path, monkeypatch):
    client = MockUsrbioClient(str(tmp_path))
    monkeypatch.setattr(store_module, "load_usrbio", lambda: client)
    store = ThreeFSKVStore(KVStoreConfig("ns", 64, path=str(tmp_path)))
    assert store.io_kind == "usrbio"
    suite.put(store, [1])
    assert client.ops["write"] == 1


def test_instances_sharing_a_mount_see_each_others_blocks(tmp_path):
    prefill = ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "posix"}))
    decode = ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "posix"}))
    suite.put(prefill, [1, 2])
    assert decode.match_prefix([key(1), key(2), key(3)]) == 2
    assert suite.read(decode, [1, 2]) == [suite.payload(1), suite.payload(2)]


def test_records_are_the_core_format(tmp_path):
    """A record written by the core ``local`` store reads back through the 3fs store."""
    local = LocalDiskKVStore(suite.config(str(tmp_path / "deepinfer-kv")))
    suite.put(local, [1])
    three = ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "posix"}))
    assert suite.read(three, [1]) == [suite.payload(1)]


def test_gc_deletes_expired_day_buckets_of_every_writer(tmp_path):
    ours = ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "posix"}))
    other = ThreeFSKVStore(suite.config(str(tmp_path), options={"io": "posix"}))
    suite.put(other, [1], retention="agent")
    suite.put(ours, [2], retention="chat")
    agent_bucket = os.path.dirname(os.path.dirname(other.record_path(key(1))))
    ours.gc(now=os.path.getmtime(agent_bucket) + 5 * 86400)  # past agent, inside chat
    assert not os.path.exists(agent_bucket)
    assert ours.match_prefix([key(2)]) == 1

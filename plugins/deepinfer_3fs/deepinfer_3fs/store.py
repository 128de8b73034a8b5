"""``3fs``: the KV store on a 3FS mount, shared by every instance that mounts it.

On 3FS the core ``local`` store's design is already the right one, so this class *is* that
store pointed at the mount, with a choice of data path:

- one file per block: FUSE does not allow concurrent writes to one file, and many small
  files spread over the storage servers;
- records under ``<retention>/<expiry day>/`` buckets: 3FS has no TTL, so ``gc`` deletes whole
  expired day directories;
- the record format and its checks come from :mod:`deepinfer_core.kv_store.records`, so a
  record written by any deepinfer store is read and verified the same way;
- misses are looked up on the mount before they are called misses, so a decode instance
  sees what a prefill instance committed.

I/O layer (store option ``io``): ``"posix"`` (plain reads/writes through FUSE), ``"usrbio"``
(``hf3fs_fuse.io`` rings, zero copy past FUSE), or ``"auto"`` (default: USRBIO when importable).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from types import ModuleType

from deepinfer_core import envs
from deepinfer_core.kv_store import KVStoreConfig
from deepinfer_core.kv_store.local import LocalDiskKVStore
from deepinfer_core.kv_store.records import PosixRecordIO, RecordIO, record_bytes

from .usrbio import UsrbioRecordIO

MOUNT_ENV = "DEEPINFER_3FS_MOUNT"
USRBIO_MODULE = "hf3fs_fuse.io"
DEFAULT_SUBDIR = "deepinfer-kv"
MAX_KEY_BYTES = 64  # USRBIO staging buffer is sized for header + key + block


class ThreeFSConfigError(ValueError):
    """The store cannot be opened as configured (no mount, unknown io, USRBIO missing)."""


def mount_path(config: KVStoreConfig) -> str:
    """The 3FS mount: option ``path``, else ``config.path``, else ``$DEEPINFER_3FS_MOUNT``."""
    mount = config.options.get("path") or config.path or envs.get(MOUNT_ENV)
    if not mount:
        raise ThreeFSConfigError(f"no 3FS mount configured (set {MOUNT_ENV} or the store option 'path')")
    if not os.path.isdir(mount):
        raise ThreeFSConfigError(f"3FS mount {mount} does not exist")
    return mount


def check_subdir(subdir) -> str:
    """The ``subdir`` option, validated: a relative path that stays under the mount (why: an
    absolute path or ``..`` made the store write, and ``gc`` delete, outside it)."""
    if not isinstance(subdir, str) or not subdir.strip("/"):
        raise ThreeFSConfigError(f"subdir {subdir!r} must be a non-empty relative path under the mount")
    if os.path.isabs(subdir) or ".." in subdir.replace("\\", "/").split("/"):
        raise ThreeFSConfigError(f"subdir {subdir!r} must be a relative path under the mount, without '..'")
    return subdir


def load_usrbio() -> ModuleType | None:
    """``hf3fs_fuse.io`` when it imports, else None (POSIX I/O still works)."""
    try:
        return importlib.import_module(USRBIO_MODULE)
    except Exception:  # a broken native build is as good as absent
        return None


class ThreeFSKVStore(LocalDiskKVStore):
    """Options: ``path`` (mount), ``subdir`` (default ``deepinfer-kv``), ``io`` (``auto`` |
    ``posix`` | ``usrbio``), ``usrbio_entries``, plus the ``local`` store's options.
    ``usrbio`` injects a client module with the ``hf3fs_fuse.io`` interface (tests)."""

    name = "3fs"

    @staticmethod
    def root_for(config: KVStoreConfig) -> Path:
        return Path(mount_path(config)) / check_subdir(config.options.get("subdir", DEFAULT_SUBDIR))

    def __init__(self, config: KVStoreConfig, *, usrbio: ModuleType | None = None) -> None:
        mount = mount_path(config)
        subdir = check_subdir(config.options.get("subdir", DEFAULT_SUBDIR))
        self.mount = mount
        self.io_kind, io = self._choose_io(config, mount, usrbio)
        root = os.path.join(mount, subdir)
        super().__init__(dataclasses.replace(config, path=root), io=io)

    @staticmethod
    def _choose_io(config: KVStoreConfig, mount: str, usrbio: ModuleType | None) -> tuple[str, RecordIO]:
        wanted = config.options.get("io", "auto")
        if wanted not in ("auto", "posix", "usrbio"):
            raise ThreeFSConfigError(f"unknown io {wanted!r}; use 'auto', 'posix' or 'usrbio'")
        if wanted == "posix":
            return "posix", PosixRecordIO()
        client = usrbio or load_usrbio()
        if client is None:
            if wanted == "usrbio":
                raise ThreeFSConfigError(f"io='usrbio' but {USRBIO_MODULE} is not importable")
            return "posix", PosixRecordIO()
        buffer_bytes = record_bytes(b"\0" * MAX_KEY_BYTES, config.block_bytes)
        entries = int(config.options.get("usrbio_entries", 8))
        return "usrbio", UsrbioRecordIO(client, mount, buffer_bytes, entries)

    def stats(self) -> dict:
        return {**super().stats(), "mount": self.mount, "io": self.io_kind}

    def close(self) -> None:
        super().close()
        close_io = getattr(self.io, "close", None)
        if close_io is not None:
            close_io()

"""Record I/O through 3FS USRBIO (``hf3fs_fuse.io``): zero-copy shared-memory rings.

USRBIO moves file data between a registered shared-memory buffer (an *iovec*) and the 3FS
storage servers without passing through FUSE; metadata (open, create, rename, unlink) still
goes through the FUSE mount. So a write here is: create the temp file through POSIX, copy the
record into the shared buffer, ``prepare`` + ``submit().wait()`` one write, close; the store
then renames it on the mount as usual. Reads mirror that.

The client module is passed in (``hf3fs_fuse.io`` in production, a mock with the same
interface in tests), so nothing here imports it at module load.
"""

from __future__ import annotations

import errno
import os
import threading
from multiprocessing.shared_memory import SharedMemory
from types import ModuleType
from typing import Sequence

from deepinfer_core.kv_store.records import open_regular

DEFAULT_ENTRIES = 8


class UsrbioRecordIO:
    """A :class:`deepinfer_core.kv_store.records.RecordIO` over one staging iovec.

    ``buffer_bytes`` must hold a whole record (header + key + block); one lock serialises
    use of the staging buffer (the store's loader runs one I/O stream per store).
    """

    def __init__(self, client: ModuleType, mount: str, buffer_bytes: int, entries: int = DEFAULT_ENTRIES) -> None:
        self._client = client
        self._shm = SharedMemory(size=buffer_bytes, create=True)
        self._iov = client.make_iovec(self._shm, mount, 0, -1)
        self._shm.unlink()  # the iovec keeps the mapping; no name is left behind in /dev/shm
        self._read_ring = client.make_ioring(mount, entries, True, 0)
        self._write_ring = client.make_ioring(mount, entries, False, 0)
        self._lock = threading.Lock()
        self.capacity = buffer_bytes

    def _transfer(self, ring, fd: int, nbytes: int, offset: int, for_read: bool) -> int:
        self._client.register_fd(fd)  # USRBIO only serves registered descriptors
        try:
            ring.prepare(self._iov[:nbytes], for_read, fd, offset)
            results = ring.submit().wait(min_results=1)
        finally:
            self._client.deregister_fd(fd)
        done = results[0].result
        if done < 0:
            raise OSError(-done, os.strerror(-done))
        return done

    def write_file(self, path: str, parts: Sequence[bytes | memoryview]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        if total > self.capacity:
            raise ValueError(f"record of {total} bytes exceeds the {self.capacity}-byte USRBIO buffer")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with self._lock:
                at = 0
                for view in views:
                    self._shm.buf[at : at + view.nbytes] = view
                    at += view.nbytes
                done = self._transfer(self._write_ring, fd, total, 0, for_read=False)
            if done != total:
                # An errno, so that callers can tell a full disk from a bug (EIO: the client
                # reported no error for the missing bytes).
                raise OSError(errno.EIO, f"USRBIO short write: {done} of {total} bytes", path)
        finally:
            os.close(fd)

    def read_file(self, path: str, offset: int, out: memoryview) -> int:
        nbytes = min(out.nbytes, self.capacity)
        fd = open_regular(path)  # a FIFO or directory at the path is an OSError, not a hang
        try:
            with self._lock:
                done = self._transfer(self._read_ring, fd, nbytes, offset, for_read=True)
                out[:done] = self._shm.buf[:done]
            return done
        finally:
            os.close(fd)

    def close(self) -> None:
        self._iov = None
        self._read_ring = self._write_ring = None
        try:
            self._shm.close()
        except BufferError:  # a client that still exports the buffer keeps the mapping alive
            pass

"""The on-disk record format shared by every file-backed KV store (``local``, the 3fs plugin).

One block is one file::

    +-------------------------- header (44 bytes, little endian) ---------------------------+
    | magic "DIKV" | version u16 | key_len u16 | namespace fp 16B | payload_len u64 |        |
    | expires_at f64 | crc32c u32                                                          |
    +-------------------------------------------------------------------------------------+
    | key (key_len bytes), then zero bytes up to the next multiple of 64                  |
    +-------------------------------------------------------------------------------------+
    | payload (payload_len bytes: the block's KV bytes)                                   |
    +-------------------------------------------------------------------------------------+

Why each field: the namespace fingerprint and the key make a record that landed at the wrong
path (another model, dtype or rank; a hash collision in a file name) a miss instead of wrong
KV; the payload length catches truncation; the CRC-32C over header, key and payload catches
torn or flipped bytes (CRC-32C, not zlib's CRC-32: the CPU computes it in hardware, 10x faster
here, and a load verifies every byte it reads; version 1 records used zlib's and are misses).
The payload starts at a multiple of :data:`PAYLOAD_ALIGN` in the file: a read whose file offset
is not cache-line aligned copied out of the page cache 2.5-3x slower here (60 vs 64 bytes:
0.9-1.2 vs 2.8-3.3 GB/s), and the padding (the zero bytes) is not covered by the checksum.
``expires_at`` lets a reader tell an expired record without a directory scan.

The file I/O itself goes through a :class:`RecordIO` so that a backend can swap POSIX calls
for another client (3FS USRBIO) and keep the format and its checks in one place.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import struct
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from crc32c import crc32c

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "PAYLOAD_ALIGN",
    "PosixRecordIO",
    "RecordHeader",
    "RecordIO",
    "VERSION",
    "decode_header",
    "encode_header",
    "is_regular_file",
    "key_from_filename",
    "namespace_fingerprint",
    "open_regular",
    "payload_matches",
    "payload_offset",
    "read_record",
    "record_bytes",
    "record_filename",
    "remove_file",
    "write_record",
]


MAGIC = b"DIKV"
VERSION = 2
_HEADER = struct.Struct("<4sHH16sQdI")
HEADER_BYTES = _HEADER.size
PAYLOAD_ALIGN = 64


def namespace_fingerprint(namespace: str) -> bytes:
    """16-byte fingerprint of a namespace string (fixed, unseeded: identical in every process)."""
    return hashlib.blake2b(namespace.encode(), digest_size=16, person=b"deepinfer-kv-ns").digest()


def payload_offset(key: bytes) -> int:
    """Where a record's payload starts: header and key, rounded up to :data:`PAYLOAD_ALIGN`."""
    return -(-(HEADER_BYTES + len(key)) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def record_bytes(key: bytes, payload_len: int) -> int:
    """Total size of a well-formed record file (lets a directory scan spot truncation)."""
    return payload_offset(key) + payload_len


@dataclass(frozen=True)
class RecordHeader:
    namespace_fp: bytes
    key: bytes
    payload_len: int
    expires_at: float
    checksum: int


def _checksum(namespace_fp: bytes, key: bytes, payload_len: int, expires_at: float, payload) -> int:
    """CRC-32C of header, key and payload; ``payload`` may be a list of pieces (a scatter read)."""
    prefix = _HEADER.pack(MAGIC, VERSION, len(key), namespace_fp, payload_len, expires_at, 0)
    crc = crc32c(key, crc32c(prefix))
    for piece in payload if isinstance(payload, list) else [payload]:
        crc = crc32c(piece, crc)
    return crc


def encode_header(namespace_fp: bytes, key: bytes, payload: memoryview, expires_at: float) -> bytes:
    """Header, key and padding; the payload is written after it unchanged (no copy)."""
    crc = _checksum(namespace_fp, key, len(payload), expires_at, payload)
    head = _HEADER.pack(MAGIC, VERSION, len(key), namespace_fp, len(payload), expires_at, crc) + key
    return head + bytes(payload_offset(key) - len(head))


def decode_header(data: bytes | memoryview, namespace_fp: bytes, key: bytes) -> RecordHeader | None:
    """Parse header+key; None when it is not a record of this namespace and key."""
    if len(data) < HEADER_BYTES:
        return None
    magic, version, key_len, fp, payload_len, expires_at, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or fp != namespace_fp or key_len != len(key):
        return None
    if bytes(data[HEADER_BYTES : HEADER_BYTES + key_len]) != key:
        return None
    return RecordHeader(fp, key, payload_len, expires_at, crc)


def payload_matches(header: RecordHeader, payload: memoryview | list[memoryview]) -> bool:
    """Length and checksum check of a payload read after ``header`` (one view or pieces)."""
    size = sum(len(p) for p in payload) if isinstance(payload, list) else len(payload)
    if size != header.payload_len:
        return False
    return _checksum(header.namespace_fp, header.key, header.payload_len, header.expires_at, payload) == header.checksum


def record_filename(key: bytes) -> str:
    """A record's file name: the key in hex (so a directory scan recovers keys without reads)."""
    return f"{key.hex()}.kv"


def key_from_filename(filename: str) -> bytes | None:
    """The key a record file name encodes, or None for anything else (temp files, junk)."""
    stem, dot, ext = filename.partition(".")
    if ext != "kv" or not dot:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def remove_file(path: str | os.PathLike) -> None:
    """Remove whatever is at ``path``, tolerating nothing being there (another process's gc,
    a bad record). A directory found at a record's path is removed too (why: otherwise the
    key could never be written again, since a rename cannot replace a directory)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except (IsADirectoryError, PermissionError):
        if not os.path.isdir(path) or os.path.islink(path):
            raise
        shutil.rmtree(path, ignore_errors=True)


def is_regular_file(path: str | os.PathLike) -> bool:
    """True only for a regular file (not a FIFO, device, directory or symlink): anything else
    at a record's path is a miss."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str | os.PathLike) -> int:
    """Open a record for reading; ``OSError`` unless it is a regular file. Non-blocking open
    (why: a FIFO at a record path would otherwise block the reader forever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


class RecordIO(Protocol):
    """Whole-file I/O used by file-backed stores (POSIX here, USRBIO in the 3fs plugin)."""

    def write_file(self, path: str, parts: Sequence[bytes | memoryview]) -> None:
        """Create ``path`` (it does not exist yet) holding ``parts`` back to back; raise
        ``OSError`` on any failure (the caller removes the partial file)."""
        ...

    def read_file(self, path: str, offset: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes at ``offset`` into ``out``; return the count. Must
        open with :func:`open_regular` (anything but a regular file is an ``OSError``)."""
        ...


class PosixRecordIO:
    """Plain ``os`` calls; the default everywhere, including on a 3FS FUSE mount."""

    def read_parts(self, path: str, outs: Sequence[memoryview]) -> int:
        """Read the file from its start into ``outs`` back to back (one open, one ``preadv``
        for a whole record: header, key and payload land in their own buffers, no copy);
        return the bytes read. Same rules as :meth:`read_file`."""
        fd = open_regular(path)
        try:
            views = [memoryview(o).cast("B") for o in outs]
            done = 0
            while views:
                n = os.preadv(fd, views, done)
                if n == 0:
                    break
                done += n
                while views and n >= len(views[0]):  # drop the parts filled, cut a partial one
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            return done
        finally:
            os.close(fd)

    def write_file(self, path: str, parts: Sequence[bytes | memoryview]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
        finally:
            os.close(fd)

    def read_file(self, path: str, offset: int, out: memoryview) -> int:
        fd = open_regular(path)
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    break
                done += n
            return done
        finally:
            os.close(fd)


def write_record(
    io: RecordIO, path: str, namespace_fp: bytes, key: bytes, payload: memoryview, expires_at: float
) -> None:
    """Write one complete record to ``path`` (a temporary name; the caller renames it)."""
    io.write_file(path, [encode_header(namespace_fp, key, payload, expires_at), payload])


def read_record(
    io: RecordIO,
    path: str,
    namespace_fp: bytes,
    key: bytes,
    out: memoryview | list[memoryview],
    keep_until: float = 0.0,
) -> bool:
    """Read the record at ``path`` into ``out`` (payload only; one view, or a list of byte
    views filled back to back). False, with ``out`` in an unspecified state, when the file is
    missing, short, of another namespace/key, past its expiry (unless ``keep_until``, a hold's
    deadline, is still ahead), or fails its checksum: the caller treats that as a miss."""
    outs = out if isinstance(out, list) else [out]
    size = sum(len(o) for o in outs)
    head = bytearray(payload_offset(key))
    try:
        read_parts = getattr(io, "read_parts", None)
        if read_parts is not None:  # one open and one read for the whole record
            if read_parts(path, [memoryview(head), *outs]) != len(head) + size:
                return False
        elif io.read_file(path, 0, memoryview(head)) != len(head):
            return False
        header = decode_header(head, namespace_fp, key)
        if header is None or header.payload_len != size or max(header.expires_at, keep_until) <= time.time():
            return False  # not this record, or past its retention (and not held): a miss
        if read_parts is None:
            offset = len(head)
            for piece in outs:
                if io.read_file(path, offset, piece) != len(piece):
                    return False
                offset += len(piece)
    except OSError:
        return False
    return payload_matches(header, outs)

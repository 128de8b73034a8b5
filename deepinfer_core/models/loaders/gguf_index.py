"""A GGUF file's tensor index and the metadata keys asked for, without ``gguf.GGUFReader``.

``GGUFReader`` turns every metadata value into numpy views, one or two per string: SmolLM2's
49,152-token vocabulary and its merges cost ~3 s of Python on every open (measured: 3.2 s on a
quiet 2-core EPYC, ~26 s under load), before a single weight is read. Serving needs only the
tensor index (name, type, shape, offset) plus a few dozen keys, and the tokenizer's arrays only
when no start-up cache entry holds the tokenizer yet. So this reader walks the header once with
``struct`` on a read-only ``mmap``: the keys a caller wants become plain Python values (what
``ReaderField.contents()`` gives), every other value is stepped over by its length, and the
tensors are described, not mapped. Types, sizes and versions come from the ``gguf`` library's
constants (``GGUFValueType``, ``GGMLQuantizationType``, ``GGML_QUANT_SIZES``,
``quant_shape_to_byte_shape``); tests compare every tensor's bytes with ``GGUFReader``'s.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

#: struct codes of the GGUF scalar value types (the spec's table; little-endian files only).
_SCALAR_CODES = {
    "UINT8": "B",
    "INT8": "b",
    "UINT16": "H",
    "INT16": "h",
    "UINT32": "I",
    "INT32": "i",
    "FLOAT32": "f",
    "BOOL": "?",
    "UINT64": "Q",
    "INT64": "q",
    "FLOAT64": "d",
}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the index: ``shape`` in numpy order (slowest dimension first, the reverse
    of GGUF's listing), ``offset`` absolute in the file, ``n_bytes`` of packed data."""

    name: str
    type_name: str  # a gguf.GGMLQuantizationType name: "Q4_1", "F32", ...
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    def data(self, file: np.ndarray) -> np.ndarray:
        """This tensor's bytes in ``file`` (a ``np.memmap`` of the whole file, uint8) as
        ``GGUFReader`` shapes quantized data: [..., bytes per row], no copy."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.type_name]
        return file[self.offset : self.offset + self.n_bytes].reshape(gguf.quant_shape_to_byte_shape(self.shape, qtype))


@dataclass(frozen=True)
class GGUFIndex:
    """What :func:`read_index` found: the wanted metadata as plain values, the tensors, where
    tensor data starts (the fingerprint hashes the header up to there)."""

    path: str
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int

    def map(self) -> np.ndarray:
        """The whole file as a read-only uint8 memmap (tensor bytes are views of it)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r")


def read_index(path: str, want: Callable[[str], bool] = lambda key: True) -> GGUFIndex:
    """Walk ``path``'s header: the metadata keys ``want`` accepts as Python values (strings
    decoded, arrays as lists), every tensor's :class:`TensorInfo`. Raises ``ValueError`` naming
    the file for anything that is not a GGUF this library's reader would accept."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _Walk(path, buf).index(want)
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: truncated or malformed GGUF header ({exc})") from exc


class _Walk:
    """A cursor over the header; each ``_value`` reads or skips one typed value."""

    def __init__(self, path: str, buf: mmap.mmap) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def _unpack(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def _str(self, keep: bool = True) -> str | None:
        n = self._unpack("Q")
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise ValueError(f"{self.path}: a string runs past the end of the file")
        return str(self.buf[start : self.pos], "utf-8") if keep else None

    def _strings(self, count: int, keep: bool) -> list[str] | None:
        """An array of strings (a vocabulary, merges): the hot loop of a cold open."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out: list[str] = []
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            if keep:
                out.append(str(buf[pos : pos + n], "utf-8"))
            pos += n
        if pos > end:
            raise ValueError(f"{self.path}: a string array runs past the end of the file")
        self.pos = pos
        return out if keep else None

    def _value(self, type_id: int, keep: bool) -> Any:
        import gguf

        vtype = gguf.GGUFValueType(type_id)
        if vtype == gguf.GGUFValueType.STRING:
            return self._str(keep)
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type, count = self._unpack("I"), self._unpack("Q")
            code = _SCALAR_CODES.get(gguf.GGUFValueType(item_type).name)
            if code is not None:  # fixed-size items: one slice
                size = struct.calcsize(code) * count
                start, self.pos = self.pos, self.pos + size
                if self.pos > len(self.buf):
                    raise ValueError(f"{self.path}: an array runs past the end of the file")
                return np.frombuffer(self.buf, np.dtype("<" + code), count, start).tolist() if keep else None
            if item_type == gguf.GGUFValueType.STRING:
                return self._strings(count, keep)
            items = [self._value(item_type, keep) for _ in range(count)]
            return items if keep else None
        code = _SCALAR_CODES[vtype.name]
        value = self._unpack(code)
        return value if keep else None

    def index(self, want: Callable[[str], bool]) -> GGUFIndex:
        import gguf

        if self._unpack("I") != gguf.GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (bad magic)")
        version = self._unpack("I")
        if version & 0xFFFF == 0:
            raise ValueError(f"{self.path}: a big-endian GGUF; only little-endian files are supported")
        if version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
            raise ValueError(
                f"{self.path}: GGUF version {version} (supported: {gguf.gguf_reader.READER_SUPPORTED_VERSIONS})"
            )
        n_tensors, n_kv = self._unpack("Q"), self._unpack("Q")
        metadata: dict[str, Any] = {}
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = self._str()
            type_id = self._unpack("I")
            if key == "general.alignment":
                alignment = self._value(type_id, True)
                if type_id != gguf.GGUFValueType.UINT32 or alignment <= 0 or alignment & (alignment - 1):
                    raise ValueError(f"{self.path}: general.alignment must be a power-of-two uint32, got {alignment!r}")
                if want(key):
                    metadata[key] = alignment
                continue
            keep = want(key)
            value = self._value(type_id, keep)
            if keep:
                metadata[key] = value
        raw = []
        for _ in range(n_tensors):
            name = self._str()
            n_dims = self._unpack("I")
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
            self.pos += 8 * n_dims
            raw.append((name, tuple(reversed(dims)), gguf.GGMLQuantizationType(self._unpack("I")), self._unpack("Q")))
        data_offset = -(-self.pos // alignment) * alignment
        tensors = []
        for name, shape, qtype, rel in raw:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block
            if data_offset + rel + n_bytes > len(self.buf):
                raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
            tensors.append(TensorInfo(name, qtype.name, shape, data_offset + rel, n_bytes))
        if len({t.name for t in tensors}) != len(tensors):
            raise ValueError(f"{self.path}: duplicated tensor names")
        return GGUFIndex(self.path, metadata, tuple(tensors), data_offset)

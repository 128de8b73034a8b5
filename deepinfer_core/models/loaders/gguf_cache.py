"""A start-up cache for GGUF checkpoints: what parsing the header and dequantizing give, ready to map.

Opening a GGUF costs up to three slow steps before the first token: walking the header's
metadata (SmolLM2's 49,152-token vocabulary and its merges), building the byte-level BPE from
it, and, for the dense path, dequantizing the block-quantized tensors in numpy. Each gives the
same result every time for the same file, so the first open writes it once, as a Hugging
Face-style directory::

    $DEEPINFER_CACHE_DIR/gguf/<key>/
        meta.json          config, special ids, chat template, general.sampling.* keys,
                           fingerprint, tensor index (name, type, shape, offset of every tensor)
        tokenizer.json     the byte-level BPE exactly as built from the GGUF metadata
        model.safetensors  float32 weights, Hugging Face names and layouts (rows unpermuted);
                           added by the first complete float weight stream

A warm open reads meta.json and tokenizer.json and not one byte of the GGUF's header: low-bit
serving (the CPU default) maps the packed tensors from the GGUF at the recorded offsets, the
dense path maps model.safetensors. The key hashes the format version and the file's size,
modification time and first and last MiB, so an edited or replaced file is a miss, and the
cached model keeps the GGUF's own fingerprint (the KV-cache namespace does not change). An
entry that cannot be read, or was written by another format version, is removed and rebuilt
from the file, never trusted. Entries are written to a temporary directory (the weights to a
temporary file) and renamed into place: a crash leaves no half entry, two processes racing both
succeed. Only checkpoints whose float32 form is at most ``DEEPINFER_GGUF_CACHE_MAX_GIB``
(default 4) get model.safetensors; ``DEEPINFER_GGUF_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from ... import envs
from .files import ModelFiles
from .gguf_index import TensorInfo

if TYPE_CHECKING:
    from ...tokenizer import Tokenizer

log = logging.getLogger("deepinfer.gguf_cache")

#: Bump when the cached form changes meaning (names, layouts, tokenizer construction, files).
FORMAT = 5  # 3: a rope_freqs tensor read into the config; 4: q/k biases in rotate-half order; 5: qwen2, o_proj_bias
_SAMPLE = 1 << 20
_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class GGUFParts:
    """What a start-up needs of a GGUF besides its tensor bytes: parsed from the header on a
    miss, read from an entry on a hit."""

    config: dict
    tokenizer: "Tokenizer | None"
    fingerprint: str
    sampling: dict  # the general.sampling.* keys as stored
    tensors: tuple[TensorInfo, ...]


def cache_dir() -> str | None:
    """Where entries live, or None when caching is turned off."""
    if not envs.get("DEEPINFER_GGUF_CACHE"):
        return None
    return os.path.join(envs.cache_dir(), "gguf")


def max_bytes() -> int:
    return int(envs.get("DEEPINFER_GGUF_CACHE_MAX_GIB") * (1 << 30))


def cache_key(path: str) -> str:
    """Cheap on a multi-GB file: size, mtime and the first and last MiB."""
    st = os.stat(path)
    h = hashlib.sha256(f"{FORMAT}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        f.seek(max(0, st.st_size - _SAMPLE))
        h.update(f.read(_SAMPLE))
    return h.hexdigest()[:32]


def entry_for(path: str) -> str | None:
    """The entry directory for ``path`` (it may not exist yet), or None when caching is off."""
    root = cache_dir()
    return None if root is None else os.path.join(root, cache_key(path))


def read_entry(entry: str) -> GGUFParts | None:
    """``entry``'s parts, or None on a miss (or when the entry cannot be read or belongs to
    another format: it is then removed, and the caller's parse of the file rewrites it)."""
    if not os.path.isfile(os.path.join(entry, "meta.json")):
        return None
    try:
        return _read_entry(entry)
    except Exception as exc:  # a damaged entry must never stop a load: the GGUF is still there
        log.warning("ignoring unreadable GGUF cache entry %s (removed; rebuilt from the file): %s", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _read_entry(entry: str) -> GGUFParts:
    import tokenizers

    from ...tokenizer import Tokenizer

    with open(os.path.join(entry, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')} != {FORMAT}")
    tokenizer = None
    if meta["tokenizer"] is not None:
        t = meta["tokenizer"]
        tokenizer = Tokenizer(
            tokenizers.Tokenizer.from_file(os.path.join(entry, "tokenizer.json")),
            bos_token_id=t["bos_token_id"],
            eos_token_id=t["eos_token_id"],
            chat_template=t["chat_template"],
            add_bos_token=t["add_bos_token"],
        )
    tensors = tuple(
        TensorInfo(name, kind, tuple(shape), offset, n_bytes) for name, kind, shape, offset, n_bytes in meta["tensors"]
    )
    if os.path.exists(os.path.join(entry, _WEIGHTS)):
        _weight_order(os.path.join(entry, _WEIGHTS))  # a damaged weights file damns the entry
    return GGUFParts(meta["config"], tokenizer, meta["fingerprint"], meta["sampling"], tensors)


def write_entry(entry: str, parts: GGUFParts) -> None:
    """Write ``entry`` (without weights) from a fresh parse; a failure only logs."""
    tok = parts.tokenizer
    meta = {
        "format": FORMAT,
        "fingerprint": parts.fingerprint,
        "config": parts.config,
        "sampling": parts.sampling,
        "tensors": [[t.name, t.type_name, list(t.shape), t.offset, t.n_bytes] for t in parts.tensors],
        "tokenizer": None
        if tok is None
        else {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "chat_template": tok.chat_template,
            "add_bos_token": tok.add_bos_token,
        },
    }
    root = os.path.dirname(entry)
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        if tok is not None:
            tok.backend.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f)
        os.rename(tmp, entry)
        tmp = None
        log.info("cached the GGUF's config and tokenizer at %s: later start-ups skip its header", entry)
    except OSError as exc:  # a read-only or full disk, or another process won the rename
        if not os.path.isdir(entry):
            log.warning("could not write the GGUF start-up cache at %s: %s", entry, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def cached_weights(files: ModelFiles, entry: str) -> ModelFiles:
    """``files`` whose float weights map ``entry``'s model.safetensors when it is there, and
    whose first complete float weight stream writes it otherwise (the packed stream is left
    alone: it reads the GGUF itself)."""
    weights_file = os.path.join(entry, _WEIGHTS)
    if os.path.isfile(weights_file):
        files.weights = lambda: _mapped(weights_file)
        return files
    stream = files.weights
    limit = max_bytes()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        kept: dict[str, torch.Tensor] | None = {}
        size = 0
        for name, tensor in stream():
            if kept is not None:
                size += tensor.numel() * tensor.element_size()
                kept = None if size > limit else kept
            if kept is not None:
                kept[name] = tensor
            yield name, tensor
        if kept is not None and os.path.isdir(entry) and not os.path.exists(weights_file):
            _write_weights(entry, kept)

    files.weights = weights
    return files


def _weight_order(weights_file: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(weights_file, framework="pt") as f:  # the header is checked against the file size
        order = json.loads((f.metadata() or {}).get("order", "null"))
        if not isinstance(order, list) or set(f.keys()) != set(order):
            raise ValueError(f"{weights_file} does not hold the tensors its order lists")
    return order


def _mapped(weights_file: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    order = _weight_order(weights_file)
    with safe_open(weights_file, framework="pt") as f:
        for name in order:
            yield name, f.get_tensor(name)


def _write_weights(entry: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=entry)
        os.close(fd)
        # tied and shared tensors are saved as separate copies: safetensors refuses aliases
        owners = Counter(v.untyped_storage().data_ptr() for v in tensors.values())
        save_file(
            {
                k: v.contiguous().clone() if owners[v.untyped_storage().data_ptr()] > 1 else v.contiguous()
                for k, v in tensors.items()
            },
            tmp,
            metadata={"order": json.dumps(list(tensors))},
        )
        os.replace(tmp, os.path.join(entry, _WEIGHTS))
        tmp = None
        log.info("cached the dequantized GGUF weights at %s: later start-ups map them instead of dequantizing", entry)
    except OSError as exc:  # a read-only or full disk, or the entry was removed meanwhile
        log.warning("could not write the GGUF start-up cache weights at %s: %s", entry, exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)

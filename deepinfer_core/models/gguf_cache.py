"""A start-up cache for GGUF checkpoints: the float32 weights and tokenizer, ready to map.

Opening a GGUF costs two slow passes before the first token: the ``gguf`` library parses every
metadata array in Python (SmolLM2's 49,152-token vocabulary and its merges), and the block-quantized
tensors are dequantized in numpy. Both give the same result every time for the same file, so the
first load writes that result once, as a Hugging Face-style directory::

    $DEEPINFER_CACHE_DIR/gguf/<key>/
        model.safetensors   float32 weights, Hugging Face names and layouts (rows unpermuted)
        tokenizer.json      the byte-level BPE exactly as built from the GGUF metadata
        meta.json           config, chat template, special ids, fingerprint, packed tensor names

and later loads memory-map it (well under a second) instead. The key hashes the file's size,
modification time and first and last MiB, so an edited or replaced file is a miss, and the
cached model keeps the GGUF's own fingerprint (the KV-cache namespace does not change). Entries
are written to a temporary directory and renamed into place: a crash leaves no half entry, two
processes racing both succeed. Only checkpoints whose float32 form is at most
``DEEPINFER_GGUF_CACHE_MAX_GIB`` (default 4) are cached; ``DEEPINFER_GGUF_CACHE=0`` turns it off.
Low-bit serving (``dtype="lowbit"``) still reads the packed tensors from the GGUF itself.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from typing import Callable, Iterator

import torch

from .files import ModelFiles

log = logging.getLogger("deepinfer.gguf_cache")

#: Bump when the cached form changes meaning (names, layouts, tokenizer construction).
FORMAT = 1
_SAMPLE = 1 << 20


def cache_dir() -> str | None:
    """Where entries live, or None when caching is turned off."""
    if os.environ.get("DEEPINFER_GGUF_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    root = os.environ.get("DEEPINFER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "deepinfer"
    )
    return os.path.join(root, "gguf")


def max_bytes() -> int:
    try:
        gib = float(os.environ.get("DEEPINFER_GGUF_CACHE_MAX_GIB", "4"))
    except ValueError:
        gib = 4.0
    return int(gib * (1 << 30))


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


def open_cached(entry: str, path: str, open_gguf: Callable[[str], ModelFiles]) -> ModelFiles | None:
    """``entry`` (of ``path``) as :class:`ModelFiles`, or None on a miss (or when the entry
    cannot be read: it is then removed and rewritten by the next full load)."""
    if not os.path.isfile(os.path.join(entry, "meta.json")):
        return None
    try:
        return _read_entry(entry, path, open_gguf)
    except Exception as exc:  # a damaged entry must never stop a load: the GGUF is still there
        log.warning("ignoring unreadable GGUF cache entry %s (removed; the next load rewrites it): %s", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _read_entry(entry: str, path: str, open_gguf: Callable[[str], ModelFiles]) -> ModelFiles:
    import tokenizers
    from safetensors import safe_open

    from ..tokenizer import Tokenizer

    with open(os.path.join(entry, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')} != {FORMAT}")
    tokenizer = None
    if meta["tokenizer"] is not None:
        t = meta["tokenizer"]
        tokenizer = Tokenizer(
            tokenizers.Tokenizer.from_file(os.path.join(entry, "tokenizer.json")),
            bos_token_id=t["bos_token_id"], eos_token_id=t["eos_token_id"],
            chat_template=t["chat_template"], add_bos_token=t["add_bos_token"],
        )
    weights_file = os.path.join(entry, "model.safetensors")
    with safe_open(weights_file, framework="pt") as f:  # the header is checked against the file size
        if set(f.keys()) != set(meta["order"]):
            raise ValueError("model.safetensors does not hold the tensors meta.json lists")

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(weights_file, framework="pt") as f:
            for name in meta["order"]:
                yield name, f.get_tensor(name)

    quantized = frozenset(meta["quantized_names"])

    def quantized_weights():
        return open_gguf(path).quantized_weights()

    return ModelFiles(
        config=meta["config"], weights=weights, tokenizer=tokenizer, source=path, fingerprint=meta["fingerprint"],
        quantized_weights=quantized_weights if quantized else None, quantized_names=quantized,
    )


def caching(files: ModelFiles, entry: str) -> ModelFiles:
    """``files`` whose first complete float weight stream also writes ``entry``."""
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
        if kept is not None and not os.path.isdir(entry):
            _write_entry(entry, files, kept)

    files.weights = weights
    return files


def _write_entry(entry: str, files: ModelFiles, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    root = os.path.dirname(entry)

    tok = files.tokenizer
    meta = {
        "format": FORMAT, "source": files.source, "fingerprint": files.fingerprint, "config": files.config,
        "order": list(tensors), "quantized_names": sorted(files.quantized_names),
        "tokenizer": None if tok is None else {
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "chat_template": tok.chat_template, "add_bos_token": tok.add_bos_token,
        },
    }
    tmp = None
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        # tied and shared tensors are saved as separate copies: safetensors refuses aliases
        owners = Counter(v.untyped_storage().data_ptr() for v in tensors.values())
        save_file({k: v.contiguous().clone() if owners[v.untyped_storage().data_ptr()] > 1 else v.contiguous()
                   for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"))
        if tok is not None:
            tok.backend.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f)
        os.rename(tmp, entry)
        tmp = None
        log.info("cached the dequantized GGUF at %s: later start-ups map it instead of dequantizing", entry)
    except OSError as exc:  # a read-only or full disk, or another process won the rename
        if not os.path.isdir(entry):
            log.warning("could not write the GGUF start-up cache at %s: %s", entry, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


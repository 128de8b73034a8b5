"""Opening a Hugging Face model directory (config.json + safetensors, single or sharded).

Weights are streamed one tensor at a time through ``safetensors.safe_open`` (memory-mapped),
so peak host memory stays near one tensor plus the model. The fingerprint hashes what
identifies the weights without reading them: config.json's bytes and each shard's safetensors
header (names, dtypes, shapes, offsets) and size. It goes into the KV-cache namespace, so it
must be stable across processes and machines (no paths, no mtimes).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Iterator

import torch

from .. import ModelFilesNotFound
from .files import FileFormat, ModelFiles

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def open_hf_dir(path: str | os.PathLike) -> ModelFiles:
    """Describe the model in ``path``; raise ``FileNotFoundError`` / ``ValueError`` saying
    exactly what is missing or malformed."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise ModelFilesNotFound(f"model directory {root!r} does not exist")
    config_path = os.path.join(root, CONFIG)
    if not os.path.isfile(config_path):
        raise ModelFilesNotFound(f"{root!r} has no {CONFIG}; not a Hugging Face model directory")
    with open(config_path, "rb") as f:
        config_bytes = f.read()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc

    shards = _shard_files(root)
    fingerprint = _fingerprint(config_bytes, root, shards)
    paths = [os.path.join(root, s) for s in shards]
    weights = _checkpoint_reader(config, paths)
    fp8 = _fp8_streams(config, paths)
    return ModelFiles(
        config=config,
        weights=fp8[0] if fp8 else weights,
        tokenizer=_load_tokenizer(root),
        source=root,
        fingerprint=fingerprint,
        **(fp8[1] if fp8 else {}),
    )


HF_DIRECTORY = FileFormat("Hugging Face directory", open_hf_dir, marker=CONFIG)


def _fp8_streams(config: dict, paths: list[str]):
    """DeepSeek-V3-style FP8 block checkpoints: (dequantizing stream, the ModelFiles fields
    that let an engine keep them FP8); None for any other checkpoint."""
    from .fp8_checkpoint import is_fp8_block_checkpoint

    if "DeepseekV4ForCausalLM" in (config.get("architectures") or []):
        return _v4_fp8_streams(config, paths)
    if not is_fp8_block_checkpoint(config):
        return None
    from .fp8_checkpoint import fp8_index, iter_dequantized, iter_keeping

    index = fp8_index(paths)
    fields = {"fp8_weights": lambda keep: iter_keeping(paths, index, keep), "fp8_names": frozenset(index)}
    return (lambda: iter_dequantized(paths, index)), fields


def _v4_fp8_streams(config: dict, paths: list[str]):
    """DeepSeek-V4's released FP8 projections (UE8M0 tile scales), kept FP8 where the engine can
    (the same fields as V3's FP8 blocks), and its MXFP4 routed experts, kept packed where the
    engine can (``mxfp4_names``; the same ``fp8_weights(keep)`` stream passes them); None for a
    checkpoint with neither."""
    from ..deepseek_v4.weights import check_checkpoint, fp8_weight_names, iter_weights, mxfp4_weight_names, read_headers

    headers = read_headers(paths)
    names, packed = fp8_weight_names(headers), mxfp4_weight_names(headers)
    if not names and not packed:
        return None
    check_checkpoint(config, headers)
    fields = {
        "fp8_weights": lambda keep: iter_weights(paths, headers, keep),
        "fp8_names": names,
        "mxfp4_names": packed,
    }
    return (lambda: iter_weights(paths, headers)), fields


def _checkpoint_reader(config: dict, paths: list[str]):
    """The weight stream for this checkpoint. DeepSeek-V4's released layout (FP8 / MXFP4, its own
    names) is checked against the config from the headers now, before any model is built, and
    dequantized under transformers' names while streaming."""
    if "DeepseekV4ForCausalLM" in (config.get("architectures") or []):
        from ..deepseek_v4.weights import check_checkpoint, iter_weights, read_headers

        headers = read_headers(paths)
        check_checkpoint(config, headers)
        return lambda: iter_weights(paths, headers)
    return lambda: _iter_tensors(paths)


def _shard_files(root: str) -> list[str]:
    """Safetensors file names, in a fixed order: the index's shards, else the single file,
    else every ``*.safetensors`` in the directory (sorted)."""
    index_path = os.path.join(root, INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{index_path} has no readable weight_map: {exc}") from exc
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not os.path.isfile(os.path.join(root, s))]
        if absent:
            raise ModelFilesNotFound(f"{index_path} names shard(s) that are not in {root!r}: {', '.join(absent)}")
        return shards
    if os.path.isfile(os.path.join(root, SINGLE)):
        return [SINGLE]
    found = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    if not found:
        raise ModelFilesNotFound(f"{root!r} has {CONFIG} but no .safetensors weights")
    return found


def _read_header(path: str) -> bytes:
    # safetensors layout: u64 little-endian header length, then that many bytes of JSON.
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(length)


def _fingerprint(config_bytes: bytes, root: str, shards: list[str]) -> str:
    digest = hashlib.sha256()
    digest.update(b"config.json\0" + config_bytes)
    for name in shards:
        path = os.path.join(root, name)
        digest.update(f"\0{name}\0{os.path.getsize(path)}\0".encode())
        digest.update(_read_header(path))
    return digest.hexdigest()


def _iter_tensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` one at a time; floating tensors become float32 (the CPU reference
    dtype; the model casts to its own dtype on copy), integer tensors keep their dtype."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor.float() if tensor.is_floating_point() else tensor


def _load_tokenizer(root: str):
    """The directory's tokenizer, or None when it ships none (or the tokenizer module is not
    available in this build)."""
    if not os.path.isfile(os.path.join(root, "tokenizer.json")):
        return None
    try:
        from ...tokenizer import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_hf_dir(root)

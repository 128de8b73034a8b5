"""What a model path resolves to: config, a weight stream, tokenizer and a weights fingerprint.

The engine only ever sees :class:`ModelFiles`, whatever the on-disk format was::

    files = open_model_files(path)                 # a .gguf file or a Hugging Face directory
    model = factory(files.config, ctx)             # factory chosen by files.config["architectures"][0]
    model.load_weights(files.weights())            # (hf_name, float tensor) pairs
    files.tokenizer.encode(...)

Loaders translate names and layouts to Hugging Face's, so each architecture implements one
``load_weights`` for every format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .. import ModelFilesNotFound

if TYPE_CHECKING:
    from ...tokenizer import Tokenizer

WeightStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class ModelFiles:
    """A model on disk, opened but not loaded: weights stream lazily, one tensor at a time."""

    config: dict  # Hugging Face style, "architectures" names the model factory
    weights: WeightStream  # each call starts a fresh stream of (hf_name, tensor)
    tokenizer: "Tokenizer | None"
    source: str  # the path it was opened from
    # Stable across processes and machines for the same weights; part of the KV-cache namespace,
    # so two different checkpoints never share cached blocks.
    fingerprint: str
    # Block-quantized checkpoints (GGUF Q4_0, Q4_1, Q4_K, Q8_0...): a second stream that yields
    # those tensors packed (``deepinfer_core.lowbit.formats.QuantWeight``) instead of as floats,
    # and the names it packs. None / empty for float checkpoints.
    quantized_weights: "WeightStream | None" = None
    quantized_names: frozenset = frozenset()
    # The GGML type names of those packed tensors ("Q4_1", "Q8_0", ...): the low-bit path's KV
    # cache dtype follows them (lowbit.attention.kv_dtype).
    quantized_types: frozenset = frozenset()
    # FP8 block checkpoints (DeepSeek-V3 style, models.fp8_checkpoint): ``weights`` dequantizes;
    # ``fp8_weights(keep)`` passes the named FP8 weights (a subset of ``fp8_names``) through
    # with their ``weight_scale_inv`` for a model holding them FP8 (models.fp8.swap_in_fp8).
    fp8_weights: "Callable[[frozenset], Iterator[tuple[str, torch.Tensor]]] | None" = None
    fp8_names: frozenset = frozenset()
    # The checkpoint's own sampling recommendation as stored in it (a GGUF's ``general.sampling.*``
    # keys, raw); the server's defaults read it here instead of opening the file again.
    sampling: dict = field(default_factory=dict)


def open_model_files(path: str) -> ModelFiles:
    """Open a ``.gguf`` file, a directory holding one ``.gguf``, or a Hugging Face directory
    (``config.json`` + safetensors). Raises :class:`FileNotFoundError` naming the path when none
    of those is there, :class:`ValueError` for a file of another kind."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelFilesNotFound(f"model path {path!r} does not exist (expected a .gguf file or a model directory)")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            from .gguf import open_gguf

            return open_gguf(path)
        raise ValueError(f"{path!r} is not a model: expected a .gguf file or a directory with config.json")
    if os.path.isfile(os.path.join(path, "config.json")):
        from .hf import open_hf_dir  # imported lazily: only HF directories need it

        return open_hf_dir(path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        from .gguf import open_gguf

        return open_gguf(os.path.join(path, ggufs[0]))
    if len(ggufs) > 1:
        raise ValueError(f"{path!r} holds several .gguf files ({', '.join(ggufs)}); pass the one to load")
    raise ModelFilesNotFound(f"no config.json or .gguf weights in {path!r}")

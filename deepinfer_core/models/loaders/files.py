"""What a model path resolves to: config, a weight stream, tokenizer and a weights fingerprint.

The engine only ever sees :class:`ModelFiles`, whatever the on-disk format was::

    files = open_model_files(path)                 # formats.py: a .gguf file or a Hugging Face directory
    model = factory(files.config, ctx)             # factory chosen by files.config["architectures"][0]
    model.load_weights(files.weights())            # (hf_name, float tensor) pairs
    files.tokenizer.encode(...)

Loaders translate names and layouts to Hugging Face's, so each architecture implements one
``load_weights`` for every format. Which loader opens a path is decided by :class:`FileFormats`,
a registry keyed by file type that the loaders' own :class:`FileFormat` declarations fill
(``formats.py``), so this module imports no loader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

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
    # those tensors as stored (``deepinfer_core.weight_format.QuantizedTensor``: GGML type, shape,
    # raw bytes) for a weight format to pack, and their names. None / empty for float checkpoints.
    quantized_weights: "WeightStream | None" = None
    quantized_names: frozenset = frozenset()
    # The GGML type names of those tensors ("Q4_1", "Q8_0", ...), for a weight format to claim
    # them by (the low-bit path's KV cache dtype follows them too).
    quantized_types: frozenset = frozenset()
    # FP8 block checkpoints (DeepSeek-V3 style, models.fp8_checkpoint): ``weights`` dequantizes;
    # ``fp8_weights(keep)`` passes the named FP8 weights (a subset of ``fp8_names``) through
    # with their ``weight_scale_inv`` for a model holding them FP8 (models.fp8.swap_in_fp8).
    fp8_weights: "Callable[[frozenset], Iterator[tuple[str, torch.Tensor]]] | None" = None
    fp8_names: frozenset = frozenset()
    # DeepSeek-V4's MXFP4 routed experts (deepseek_v4.weights.mxfp4_weight_names): ``weights``
    # dequantizes them; ``fp8_weights(keep)`` passes those named in ``keep`` packed (uint8) with
    # their UE8M0 exponents as ``weight_scale_inv`` (uint8), for models.mxfp4.swap_in_mxfp4.
    mxfp4_names: frozenset = frozenset()
    # The checkpoint's own sampling recommendation as stored in it (a GGUF's ``general.sampling.*``
    # keys, raw); the server's defaults read it here instead of opening the file again.
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FileFormat:
    """A kind of model on disk and the loader that opens it, keyed by file type: ``suffix`` for a
    single file (``".gguf"``, also the one such file in a directory), ``marker`` for a directory
    holding that file (``"config.json"``). Each loader declares its own (``gguf.GGUF_FILE``,
    ``hf.HF_DIRECTORY``); ``formats.py`` lists them."""

    name: str  # "GGUF file", "Hugging Face directory"
    open: Callable[[str], ModelFiles]
    suffix: str | None = None
    marker: str | None = None


class FileFormats:
    """The registry of :class:`FileFormat` by file type, and how a path finds its format: a file
    by its suffix; a directory by a marker file first, else by the one file of a known suffix in
    it. Knows no loader: they arrive as the formats it is built from."""

    def __init__(self, formats: Iterable[FileFormat]) -> None:
        self.by_suffix: dict[str, FileFormat] = {}
        self.by_marker: dict[str, FileFormat] = {}
        for fmt in formats:
            if (fmt.suffix is None) == (fmt.marker is None):
                raise ValueError(f"file format {fmt.name!r} needs exactly one of a suffix and a marker file")
            table, key = (self.by_suffix, fmt.suffix) if fmt.suffix is not None else (self.by_marker, fmt.marker)
            if key in table:
                raise ValueError(f"file formats {table[key].name!r} and {fmt.name!r} both claim {key!r}")
            table[key] = fmt

    def open(self, path: str | os.PathLike) -> ModelFiles:
        """Open ``path`` with the format its type names. Raises :class:`ModelFilesNotFound`
        naming the path when no model is there, :class:`ValueError` for a file of another kind
        or a directory holding several candidate files."""
        path = os.fspath(path)
        files = " or ".join(f"a {suffix} file" for suffix in self.by_suffix)
        if not os.path.exists(path):
            raise ModelFilesNotFound(f"model path {path!r} does not exist (expected {files} or a model directory)")
        if os.path.isfile(path):
            fmt = next((f for suffix, f in self.by_suffix.items() if path.endswith(suffix)), None)
            if fmt is None:
                dirs = " or ".join(f"a directory with {marker}" for marker in self.by_marker)
                raise ValueError(f"{path!r} is not a model: expected {files} or {dirs}")
            return fmt.open(path)
        for marker, fmt in self.by_marker.items():
            if os.path.isfile(os.path.join(path, marker)):
                return fmt.open(path)
        for suffix, fmt in self.by_suffix.items():
            found = sorted(f for f in os.listdir(path) if f.endswith(suffix))
            if len(found) == 1:
                return fmt.open(os.path.join(path, found[0]))
            if len(found) > 1:
                raise ValueError(f"{path!r} holds several {suffix} files ({', '.join(found)}); pass the one to load")
        wanted = " or ".join([*self.by_marker, *(f"{suffix} weights" for suffix in self.by_suffix)])
        raise ModelFilesNotFound(f"no {wanted} in {path!r}")

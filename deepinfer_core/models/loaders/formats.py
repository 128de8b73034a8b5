"""The model file formats deepinfer opens, keyed by file type, and :func:`open_model_files`.

Each loader declares its format beside its reader (``hf.HF_DIRECTORY``, ``gguf.GGUF_FILE``);
``files.FileFormats`` is the registry they fill and decides which one a path is, so ``files.py``
(what every loader returns) imports none of them and a new file type is one more entry here.
"""

from __future__ import annotations

import os

from .files import FileFormats, ModelFiles
from .gguf import GGUF_FILE
from .hf import HF_DIRECTORY

BUILTIN_FORMATS = FileFormats([HF_DIRECTORY, GGUF_FILE])  # a config.json directory wins over a lone .gguf in it


def open_model_files(path: str | os.PathLike, formats: FileFormats = BUILTIN_FORMATS) -> ModelFiles:
    """Open a ``.gguf`` file, a directory holding one ``.gguf``, or a Hugging Face directory
    (``config.json`` + safetensors). Raises :class:`FileNotFoundError` naming the path when none
    of those is there, :class:`ValueError` for a file of another kind."""
    return formats.open(path)

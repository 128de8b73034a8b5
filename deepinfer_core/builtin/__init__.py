"""The builtin behaviour of deepinfer, itself written as plugins (all hooks ``trylast``)."""

from __future__ import annotations

from . import catalogues, kernels, lowbit, platforms

BUILTIN_PLUGINS = {
    "core.platforms": platforms,
    "core.kernels": kernels,
    "core.catalogues": catalogues,
    lowbit.NAME: lowbit,  # the low-bit CPU backend (packed GGUF weights, C kernels)
}


def core_version() -> str:
    try:
        from importlib.metadata import version

        return version("deepinfer-core")
    except Exception:
        return "0+unknown"

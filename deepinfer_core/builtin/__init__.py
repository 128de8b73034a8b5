"""The builtin behaviour of deepinfer, itself written as plugins (all hooks ``trylast``)."""

from __future__ import annotations

from . import catalogues, kernels, platforms

BUILTIN_PLUGINS = {
    "core.platforms": platforms,
    "core.kernels": kernels,
    "core.catalogues": catalogues,
}


def core_version() -> str:
    try:
        from importlib.metadata import version

        return version("deepinfer-core")
    except Exception:
        return "0+unknown"

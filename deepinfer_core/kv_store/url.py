"""Choosing a persistent KV store by URL: ``--kv-store local:///var/cache/deepinfer``.

The scheme names a backend registered through ``deepinfer_register_kv_stores`` (``memory``,
``local``, ``3fs`` from the deepinfer-3fs plugin, or any plugin's); the path is the store's
directory or mount; query parameters become store options (``3fs:///mnt/3fs?io=posix&subdir=kv``).

Front ends pass ``kv_store`` / ``kv_store_gib`` (engine options, so every command's
``--kv-store`` and ``--kv-store-gib`` come from ``EngineConfig``) to ``LLM``/``EngineConfig``; the
engine opens the store itself (it knows the namespace and block size) with
:func:`open_kv_store_url`. Tools that open a store without an engine (``deepinfer kv``) use
:func:`parse_kv_store_url` and :func:`open_kv_store_url` directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from . import KVStore, KVStoreConfig


@dataclass(frozen=True)
class KVStoreURL:
    scheme: str  # the registered backend name
    path: str | None  # directory or mount; None when the URL has none (memory://)
    options: dict = field(default_factory=dict)


def parse_kv_store_url(url: str) -> KVStoreURL:
    """``scheme://[/path][?opt=value&...]``; ValueError naming the URL when it has no scheme."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(
            f"kv_store {url!r} is not a URL: use scheme://path, e.g. local:///var/cache/deepinfer or memory://"
        )
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    parts = urlsplit("//" + rest)  # not urlsplit(url): a scheme such as "3fs" (a leading digit) is not parsed as one
    path = unquote(parts.netloc + parts.path) or None
    return KVStoreURL(scheme, path, dict(parse_qsl(parts.query)))


def open_kv_store_url(
    url: str, *, namespace: str, block_bytes: int, host, capacity_gib: float | None = None
) -> KVStore:
    """Open the store a URL names among the backends ``host`` registered (a ``PluginHost``, or
    anything whose ``kv_stores()`` maps schemes to factories: the caller chooses the plugins, this
    module imports no plugin host). An unknown scheme is a ValueError listing the installed
    backends. ``capacity_gib`` caps the store (least recently used blocks are evicted)."""
    parsed = parse_kv_store_url(url)
    stores = host.kv_stores()
    if parsed.scheme not in stores:
        raise ValueError(
            f"unknown KV store scheme {parsed.scheme!r} in {url!r}; installed backends: {', '.join(sorted(stores))}"
        )
    capacity = None
    if capacity_gib is not None:
        if not isinstance(capacity_gib, (int, float)) or isinstance(capacity_gib, bool) or not capacity_gib > 0:
            raise ValueError(f"kv_store_gib must be a positive number of GiB, got {capacity_gib!r}")
        capacity = max(1, int(capacity_gib * 2**30) // block_bytes)
    config = KVStoreConfig(
        namespace=namespace, block_bytes=block_bytes, path=parsed.path, capacity_blocks=capacity, options=parsed.options
    )
    return stores[parsed.scheme](config)

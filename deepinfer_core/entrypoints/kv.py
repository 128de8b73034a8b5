"""``deepinfer kv stats|gc|ls --kv-store URL``: the operator's view of a persistent KV store.

A store directory holds one subdirectory per namespace (model, dtype, layout, block size);
each names its namespace and block size in ``namespace.json``, so these commands open every
namespace with its own block size (a wrong one would make the scan drop its records).
``gc`` deletes blocks past their retention and abandoned temp files; with ``--kv-store-gib``
it also trims each namespace to that size, least recently used blocks first.
"""

from __future__ import annotations

import argparse
import json
import sys

from .engine_options import add_engine_options, require

COMMANDS = {
    "stats": "counters of every namespace in the store (summed over every process that used it), as JSON",
    "gc": "delete expired blocks and abandoned writes (and trim to --kv-store-gib)",
    "ls": "one line per namespace: blocks, size, block size",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "kv",
        help="inspect and clean a persistent KV store",
        description="deepinfer kv stats|gc|ls --kv-store URL: the operator's view of a persistent KV store.",
    )
    sub = parser.add_subparsers(dest="kv_command", metavar="ACTION", required=True)
    for name, text in COMMANDS.items():
        action = sub.add_parser(name, help=text, description=text)
        add_engine_options(action, only=("kv_store", "kv_store_gib"), required=("kv_store",), title="KV store")
        if name != "stats":
            action.add_argument("--json", action="store_true", help="print JSON")
        action.set_defaults(func=run)
    return parser


def open_namespaces(url: str, capacity_gib: float | None = None, host=None) -> list:
    """Every namespace stored under ``url``'s root, opened (empty for a store that keeps
    nothing across processes, e.g. ``memory://``)."""
    from ..kv_store.local import stored_namespaces
    from ..kv_store.url import open_kv_store_url, parse_kv_store_url
    from ..plugin_host import PluginHost

    host = host or PluginHost()
    parsed = parse_kv_store_url(url)
    factory = host.kv_stores().get(parsed.scheme)
    if factory is None:
        open_kv_store_url(url, namespace="-", block_bytes=1, host=host)  # raises, listing the backends
    root_for = getattr(factory, "root_for", None)
    if root_for is None:
        return []
    from .. import kv_store

    root = root_for(kv_store.KVStoreConfig(namespace="-", block_bytes=1, path=parsed.path, options=parsed.options))
    return [
        open_kv_store_url(url, namespace=ns, block_bytes=block_bytes, capacity_gib=capacity_gib, host=host)
        for ns, block_bytes in stored_namespaces(root)
    ]


def run(args: argparse.Namespace) -> int:
    missing = require(args, "kv_store")
    if missing:
        print(f"deepinfer kv {args.kv_command}: error: {missing}", file=sys.stderr)
        return 2
    try:
        stores = open_namespaces(args.kv_store, getattr(args, "kv_store_gib", None))
    except ValueError as exc:
        print(f"deepinfer kv: error: {exc}", file=sys.stderr)
        return 2
    rows = []
    for store in stores:
        removed = store.gc() if args.kv_command == "gc" else None
        shared = getattr(store, "shared_stats", None)  # a backend without it: this process's counts
        stats = shared() if shared is not None else store.stats()
        rows.append(
            {
                "namespace": store.config.namespace,
                "block_bytes": store.config.block_bytes,
                **stats,
                **({"removed": removed} if removed is not None else {}),
            }
        )
        store.close()
    if args.kv_command == "stats" or args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if not rows:
        print(f"no namespaces in {args.kv_store}")
    for row in rows:
        extra = f"  removed {row['removed']}" if "removed" in row else ""
        print(
            f"{row['namespace'][:16]}  {row['blocks']:>8} blocks  {row['bytes'] / 2**30:8.3f} GiB  block "
            f"{row['block_bytes']} B{extra}"
        )
    return 0

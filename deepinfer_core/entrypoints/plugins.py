"""``deepinfer plugins``: what was discovered, its version, and whether it is usable here."""

from __future__ import annotations

import argparse
import json


def short_hook_name(hook: str) -> str:
    """``deepinfer_register_kv_stores`` -> ``kv_stores``; ``deepinfer_platform`` -> ``platform``."""
    for prefix in ("deepinfer_register_", "deepinfer_"):
        if hook.startswith(prefix):
            return hook[len(prefix) :]
    return hook


def plugin_rows() -> list[dict]:
    """One row per discovered plugin, with a fresh probe (what ``deepinfer plugins`` shows)."""
    from ..plugin_host import PluginHost

    rows = []
    for info in PluginHost().plugins():
        rows.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "contract": info.contract,
                "builtin": info.builtin,
                "hooks": [short_hook_name(h) for h in info.hooks],
                "usable": info.usable,
                "reason": info.reason,
                "note": info.note,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    header = ("NAME", "DISTRIBUTION", "VERSION", "CONTRACT", "HOOKS", "USABLE")
    lines = [
        (
            r["name"],
            r["distribution"],
            r["version"] or "-",
            r["contract"] or "-",
            ",".join(r["hooks"]) or "-",
            ("yes" if r["usable"] else "no")
            + (f" ({r['reason']})" if r["reason"] else "")
            + (f"; {r['note']}" if r["note"] else ""),
        )
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header) - 1)]
    out = []
    for row in [header, *lines]:
        cells = [str(cell).ljust(width) for cell, width in zip(row, widths)]
        out.append("  ".join([*cells, row[-1]]))
    return "\n".join(out)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plugins", help="list discovered plugins and whether they are usable here")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    rows = plugin_rows()
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    if not args.json:
        from ..builtin.cpu_features import cpu_summary

        print(f"\ncpu: {cpu_summary()}")
    return 0

"""The ``deepinfer`` command line.

Every subcommand is a ``cmd_<name>(args) -> int`` function plus an ``add_<name>_parser``
function that adds its subparser and sets ``func``; all are registered in :data:`SUBCOMMANDS`.
``generate`` lives in its own module (``deepinfer_core.entrypoints.generate``, same convention:
``add_parser(subparsers)`` setting ``func=run``) and is offered only when that module exists. It
is imported when the parser is built, so it keeps its top-level imports light and imports the
engine inside ``run``; ``plugins`` and ``version`` never import the engine.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from typing import Callable, Sequence

from .serve import add_parser as add_serve_parser

GENERATE_MODULE = "deepinfer_core.entrypoints.generate"


# -- deepinfer plugins ------------------------------------------------------------------------
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


def add_plugins_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plugins", help="list discovered plugins and whether they are usable here")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(func=cmd_plugins)
    return parser


def cmd_plugins(args: argparse.Namespace) -> int:
    rows = plugin_rows()
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    if not args.json:
        from ..builtin.cpu_features import cpu_summary

        print(f"\ncpu: {cpu_summary()}")
    return 0


# -- deepinfer version ------------------------------------------------------------------------
def add_version_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("version", help="print the deepinfer-core version")
    parser.set_defaults(func=cmd_version)
    return parser


def cmd_version(args: argparse.Namespace) -> int:
    import torch

    from ..builtin import core_version

    print(f"deepinfer-core {core_version()} (python {sys.version.split()[0]}, torch {torch.__version__})")
    return 0


# -- registration -----------------------------------------------------------------------------
from ..plan import add_parser as add_plan_parser  # noqa: E402  (light: imports the engine in run)

SUBCOMMANDS: list[Callable] = [
    add_plugins_parser,
    add_version_parser,
    add_plan_parser,
    add_serve_parser,
]  # the one registration point
from .kv import add_kv_parser  # noqa: E402  (deepinfer kv: its own module)

SUBCOMMANDS.append(add_kv_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="deepinfer inference engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(sub)
    if importlib.util.find_spec(GENERATE_MODULE) is not None:
        importlib.import_module(GENERATE_MODULE).add_parser(sub)
    return parser


def _show_deepinfer_logs() -> None:
    """The CLI prints deepinfer's own INFO lines on stderr (the engine's start-up line: model,
    platform, dtype, how the weights are held and why) and every library's warnings;
    ``DEEPINFER_LOG_LEVEL=warning`` hides the INFO lines. ``LLM(...)`` used as a library leaves
    logging to the application."""
    level = logging.getLevelName(os.environ.get("DEEPINFER_LOG_LEVEL", "INFO").upper())
    if not isinstance(level, int):
        level = logging.INFO
    root = logging.getLogger()
    if root.handlers:  # configured by whoever called main()
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(lambda record: record.levelno >= logging.WARNING or record.name.startswith("deepinfer"))
    root.addHandler(handler)
    root.setLevel(min(level, logging.WARNING))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _show_deepinfer_logs()
    return int(args.func(args) or 0)


def console_main() -> None:
    """The ``deepinfer`` console script: :func:`main`, then an exit without the interpreter's
    module teardown (``fast_exit``: 3-4 s after the last token on a busy machine)."""
    from ..fast_exit import exit_process

    try:
        status = main()
    except SystemExit as exc:  # argparse's usage errors and --help
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    exit_process(status)


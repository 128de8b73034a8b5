"""The ``deepinfer`` command line: one module per command in this package.

A command is a module with ``add_parser(subparsers)`` (adds its subparser and sets
``func``) and ``run(args) -> int`` (the exit status), listed in :data:`COMMANDS`; a later
command is one more module and one more line there. Modules are imported when the parser is
built, so they keep their top-level imports light (no torch, no engine) and import the engine
inside ``run``. Engine options come from ``EngineConfig`` (:mod:`.engine_options`).

Errors a user can fix print one line, ``deepinfer <command>: error: ...``, and exit 2 (argparse's
usage errors too: ``--help`` shows the usage); output cut short by a closed pipe
(``deepinfer plugins --json | head -1``) ends quietly.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from .. import envs

COMMANDS = (
    "deepinfer_core.entrypoints.generate",
    "deepinfer_core.entrypoints.serve",
    "deepinfer_core.entrypoints.cluster",
    "deepinfer_core.entrypoints.plan",
    "deepinfer_core.entrypoints.kv",
    "deepinfer_core.entrypoints.plugins",
    "deepinfer_core.entrypoints.version",
    "deepinfer_core.entrypoints.train_drafter",
)  # the one registration point


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``deepinfer serve: error: argument --port:
    a port is 1-65535, got 99999``), like every other error the commands print."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="deepinfer", description="deepinfer inference engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def _show_deepinfer_logs() -> None:
    """The CLI prints deepinfer's own INFO lines on stderr (the engine's start-up line: model,
    platform, dtype, how the weights are held and why) and every library's warnings;
    ``DEEPINFER_LOG_LEVEL=warning`` hides the INFO lines. ``LLM(...)`` used as a library leaves
    logging to the application."""
    level = logging.getLevelName(envs.get("DEEPINFER_LOG_LEVEL").upper())
    root = logging.getLogger()
    if root.handlers:  # configured by whoever called main()
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(lambda record: record.levelno >= logging.WARNING or record.name.startswith("deepinfer"))
    root.addHandler(handler)
    root.setLevel(min(level, logging.WARNING))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # for a command that parses its words again over a file's (cluster --config)
    try:
        _show_deepinfer_logs()
    except envs.EnvError as exc:
        print(f"deepinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except envs.EnvError as exc:  # a bad DEEPINFER_* value met while running
        print(f"deepinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2


def console_main() -> None:
    """The ``deepinfer`` console script: :func:`main`, then an exit without the interpreter's
    module teardown (``fast_exit``: 3-4 s after the last token on a busy machine)."""
    from ..fast_exit import exit_process

    try:
        status = main()
        sys.stdout.flush()  # a closed pipe shows here, not at the exit
    except SystemExit as exc:  # argparse's usage errors and --help
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BrokenPipeError:
        status = _closed_pipe()
    exit_process(status)


def _closed_pipe() -> int:
    """stdout's reader went away (``| head -1``): no traceback, and nothing more written to it
    (the interpreter's own flush at exit would fail again); status 1, as Python's documentation
    of SIGPIPE recommends."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1

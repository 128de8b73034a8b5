"""Every ``deepinfer`` command: one module per command, registered in :mod:`.main`."""

from .main import build_parser, console_main, main

__all__ = ["build_parser", "console_main", "main"]

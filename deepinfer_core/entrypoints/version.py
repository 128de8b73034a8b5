"""``deepinfer version``: the core's version, Python's and torch's."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("version", help="print the deepinfer-core version")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import torch

    from ..builtin import core_version

    print(f"deepinfer-core {core_version()} (python {sys.version.split()[0]}, torch {torch.__version__})")
    return 0

"""Checks on the hook specifications themselves, shared by the core's and plugins' tests."""

from __future__ import annotations

import inspect
import re

from .. import hookspecs

__all__ = ["documentation_problems", "hookspec_functions"]


def hookspec_functions() -> dict[str, object]:
    """Every hook spec in :mod:`deepinfer_core.hookspecs`, by name."""
    marker = f"{hookspecs.PROJECT}_spec"
    return {name: fn for name, fn in vars(hookspecs).items() if inspect.isfunction(fn) and hasattr(fn, marker)}


def documentation_problems() -> list[str]:
    """A list of what is wrong with the hook specs' docstrings (empty when all is well).

    Every spec must be prefixed ``deepinfer_`` and its docstring must say who calls it
    ("Called by ..." / "Called once ...") and what it returns (a ``:return:`` field).
    """
    problems = []
    for name, fn in hookspec_functions().items():
        doc = inspect.getdoc(fn) or ""
        if not name.startswith("deepinfer_"):
            problems.append(f"{name}: hook names start with 'deepinfer_'")
        if not doc.strip():
            problems.append(f"{name}: no docstring")
            continue
        if not re.search(r"\bCalled\b", doc):
            problems.append(f"{name}: docstring does not say who calls it ('Called by ...')")
        if ":return:" not in doc:
            problems.append(f"{name}: docstring has no ':return:' field")
    return problems

"""Limits on the JSON a request carries or the model writes, checked without recursion.

Request bodies arrive as already-decoded Python values; deeply nested ones (tool schemas,
arguments, Anthropic ``tool_use.input``) would raise ``RecursionError`` later in ``json.dumps``
or a tokenizer, a lone surrogate would fail inside the tokenizer, and a ``NaN`` would be echoed
into a JSON reply that clients cannot parse. :func:`check_body` walks the whole body once, with
an explicit stack, and refuses all of these with a :class:`ProtocolError` (400) that names the
place and the limit. :func:`loads_strict` is the same policy for JSON text (tool-call arguments
in a request, parameter values in the model's output).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from deepinfer_core.codecs import ProtocolError


@dataclass(frozen=True)
class JsonLimits:
    """``max_depth`` counts containers from the body (or the parsed text) down: ``{"a": [1]}``
    is 2 deep. Chosen far above what real schemas or arguments use (a few levels to ~20) and far
    below Python's recursion limit, so every later ``json.dumps``/``json.loads`` is safe."""

    max_depth: int = 128
    max_items: int = 1_000_000  # objects, arrays, strings and numbers in one body
    max_string: int = 32 * 1024 * 1024  # characters in one string (the server caps the body size too)


LIMITS = JsonLimits()


def _fail(param: str, message: str) -> ProtocolError:
    return ProtocolError(f"{param}: {message}", param=param)


def _path(parent: str, key: Any) -> str:
    return f"{parent}[{key}]" if isinstance(key, int) else (f"{parent}.{key}" if parent else str(key))


def check_string(text: str, param: str, limits: JsonLimits = LIMITS) -> None:
    if len(text) > limits.max_string:
        raise _fail(param, f"string longer than {limits.max_string} characters (limit)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _fail(
            param, f"contains a lone surrogate (U+{ord(text[exc.start]):04X}); text must be valid Unicode"
        ) from None


def check_body(body: Any, param: str = "", limits: JsonLimits = LIMITS) -> None:
    """Refuse (400) anything that is not plain, finite, valid-Unicode JSON within ``limits``."""
    stack: list[tuple[Any, str, int]] = [(body, param, 0)]
    items = 0
    while stack:
        value, where, depth = stack.pop()
        items += 1
        if items > limits.max_items:
            raise _fail(param or "body", f"more than {limits.max_items} JSON values (limit)")
        name = where or "body"
        if isinstance(value, str):
            check_string(value, name, limits)
        elif isinstance(value, bool) or value is None or isinstance(value, int):
            continue
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _fail(name, f"{value!r} is not a finite number (JSON has no NaN or Infinity)")
        elif isinstance(value, (dict, list)):
            if depth + 1 > limits.max_depth:
                raise _fail(name, f"nested deeper than {limits.max_depth} levels (limit)")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise _fail(name, f"object keys must be strings, got {type(key).__name__}")
                    check_string(key, name, limits)
                    stack.append((item, _path(where, key), depth + 1))
            else:
                stack.extend((item, _path(where, i), depth + 1) for i, item in enumerate(value))
        else:
            raise _fail(name, f"must be a JSON value, got {type(value).__name__}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(text: str, limits: JsonLimits = LIMITS) -> Any:
    """``json.loads`` that refuses NaN / Infinity and nesting past ``limits.max_depth``;
    raises ``ValueError`` for every refusal (never ``RecursionError``)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"nested deeper than {limits.max_depth} levels (limit)") from None
    try:
        check_body(value, limits=limits)
    except ProtocolError as exc:
        raise ValueError(exc.message) from None
    return value

"""A command's options from a YAML file (``deepinfer cluster --config FILE.yaml``).

The file is a mapping of long option names, spelt with ``-`` or ``_``, to values. Each entry
becomes the words of its flag and goes through the command's own parser, so a file is checked
exactly as a command line is::

    decode: 2                  --decode 2
    kv_store: local:///tmp/kv  --kv-store local:///tmp/kv
    enforce-eager: false       --no-enforce-eager              (a switch: true / false)
    autoscale: [decode=1:4]    --autoscale decode=1:4          (a repeatable flag: a list,
    autoscale: {decode: "1:4"} --autoscale decode=1:4           or a mapping of KEY: VALUE)

The command line is then parsed over the file's values, so a flag given there wins (a
repeatable flag's words come after the file's). Every refusal is a ``ValueError`` of one line
that names the file and the key.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Callable, Iterable

__all__ = ["option_words", "parse_over_file", "read_mapping"]


class _Refusing(argparse.ArgumentParser):
    """A parser whose usage errors raise (the caller names the key) instead of exiting."""

    def error(self, message: str):
        raise ValueError(message)


def read_mapping(path: str) -> dict:
    """The YAML file at ``path`` as a dict (an empty file: no options)."""
    try:
        import yaml
    except ImportError:
        raise ValueError("--config needs PyYAML: pip install 'deepinfer-core[cluster]'") from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ValueError(f"--config {path}: not valid YAML{line}: {getattr(exc, 'problem', None) or exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got {_kind(data)}")
    return data


def option_words(key: str, value, *, switch: bool, repeatable: bool) -> list[str]:
    """The command-line words of one file entry (``key`` already a parser destination);
    ``None`` gives none (the option's default)."""
    flag = "--" + key.replace("_", "-")
    if value is None:
        return []
    if switch:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {_kind(value)} {value!r}")
        return [flag] if value else ["--no-" + flag[2:]]
    if repeatable:
        items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else [value]
        if not all(_scalar(v) for v in items):
            raise ValueError(f"expected a value, a list or a mapping of values, got {value!r}")
        if isinstance(value, dict):
            items = [f"{k}={v}" for k, v in value.items()]
        return [word for v in items for word in (flag, str(v))]
    if not _scalar(value):
        raise ValueError(f"expected one value, got {_kind(value)} {value!r}")
    return [flag, str(value)]


def parse_over_file(
    make_parser: Callable[[type], argparse.ArgumentParser],
    argv: Iterable[str],
    path: str,
    *,
    switches: frozenset,
    repeatable: frozenset,
    not_options: frozenset = frozenset(),
) -> argparse.Namespace:
    """``argv`` parsed over the options of the file at ``path``. ``make_parser(parser_class)``
    builds the command's parser (``argv`` already passed it once); ``switches`` and
    ``repeatable`` name the destinations that are ``--x`` / ``--no-x`` and repeatable flags;
    ``not_options`` the destinations a file may not set (``config`` itself)."""
    data = read_mapping(path)
    known = set(vars(make_parser(_Refusing).parse_args([]))) - set(not_options)
    words: list[str] = []
    for key, value in data.items():
        dest = key.replace("-", "_") if isinstance(key, str) else None
        if dest not in known:
            near = difflib.get_close_matches(str(dest), sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"--config {path}: unknown key {key!r}{hint}")
        try:
            entry = option_words(dest, value, switch=dest in switches, repeatable=dest in repeatable)
            make_parser(_Refusing).parse_args(entry)  # refused here, the key is known
        except ValueError as exc:
            message = str(exc)
            if message.startswith("argument "):  # argparse's "argument --decode/-d: ..."
                message = message.split(": ", 1)[-1]
            raise ValueError(f"--config {path}: key {key!r}: {message}") from None
        words += entry
    from_file = make_parser(_Refusing).parse_args(words)
    return make_parser(_Refusing).parse_args(list(argv), namespace=from_file)


def _scalar(value) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", bool: "a boolean", str: "text"}.get(type(value), type(value).__name__)

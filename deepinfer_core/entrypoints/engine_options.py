"""The engine options every command takes, generated from :class:`EngineConfig`'s fields.

Each field of ``deepinfer_core/engine/config.py`` becomes ``--field-name`` with the field's
help, default and choices (a boolean becomes ``--name`` / ``--no-name``), so ``deepinfer
generate``, ``serve`` and ``plan`` and ``LLM(model, **options)`` cannot disagree about a name or
a default. This module imports no torch (parsers are built for every command).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable

from ..engine.config import engine_options

DEFAULT_MODEL = "smollm2-135m-instruct"
GROUP_TITLE = "engine options (the same in generate, serve and plan; LLM(model, **options) takes the same names)"
# flags kept from before the options were generated (hidden from --help)
ALIASES = {"enable_prefix_caching": {"--no-prefix-caching": False}}


def add_model_option(parser: argparse.ArgumentParser, *, help: str | None = None) -> None:
    parser.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=(help or "path to a GGUF file / HF directory, or an installed alias") + f" (default: {DEFAULT_MODEL})",
    )


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _describe_default(f: dataclasses.Field) -> str:
    if f.metadata.get("default_text"):
        return f.metadata["default_text"]
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return str(f.default)


def _number(kind: type, *, positive: bool):
    """An argparse type: a number of ``kind``, > 0 (float) or >= 1 (int) where ``positive``,
    refused with the value when it is not."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}"
            )
        if positive and not value > 0:
            raise argparse.ArgumentTypeError(f"must be {'>= 1' if kind is int else '> 0'}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


positive_float = _number(float, positive=True)


class _Switch(argparse.Action):
    """``--name`` sets True, ``--no-name`` False (argparse's BooleanOptionalAction, without the
    default it appends to the help a second time)."""

    def __init__(self, option_strings, dest, default=None, help=None, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


# options checked by EngineConfig.__post_init__ as positive; argparse refuses them at once
_POSITIVE = {
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_blocks",
    "kv_cache_gib",
    "block_size",
    "max_model_len",
    "kv_host_pool_gib",
    "kv_store_gib",
}


def add_engine_options(
    parser: argparse.ArgumentParser,
    *,
    only: Iterable[str] | None = None,
    required: Iterable[str] = (),
    title: str = GROUP_TITLE,
) -> argparse._ArgumentGroup:
    """Add ``--<field>`` for every engine option (or those named in ``only``) to ``parser``,
    in a group of their own; :func:`engine_kwargs` collects them from the parsed namespace.
    ``required`` options are marked so in the help; the command checks them (:func:`require`),
    so that an alias may set them too."""
    fields = engine_options()
    if only is not None:
        wanted = set(only)
        unknown = wanted - {f.name for f in fields}
        if unknown:
            raise ValueError(f"not engine options: {', '.join(sorted(unknown))}")
        fields = tuple(f for f in fields if f.name in wanted)
    required = set(required)
    group = parser.add_argument_group(title)
    for f in fields:
        meta = f.metadata
        text = meta["help"]
        text += " (required)" if f.name in required else f" (default: {_describe_default(f)})"
        kwargs: dict[str, Any] = {"dest": f.name, "help": text.replace("%", "%%"), "default": f.default}
        if f.type in ("bool", "bool | None"):
            group.add_argument(flag(f.name), "--no-" + flag(f.name)[2:], action=_Switch, **kwargs)
        else:
            kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(f.type)
            if kind is not None:
                kwargs["type"] = _number(kind, positive=f.name in _POSITIVE)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            elif kind is not None:
                kwargs["metavar"] = "N"
            group.add_argument(flag(f.name), **kwargs)
        for alias, value in ALIASES.get(f.name, {}).items():
            group.add_argument(
                alias, dest=f.name, action="store_const", const=value, default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )
    return group


def require(args: argparse.Namespace, *names: str) -> str | None:
    """The usage error for the first of ``names`` not given on the command line, else None."""
    for name in names:
        if not hasattr(args, name) or getattr(args, name) is None:
            return f"{flag(name)} is required"
    return None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of a parsed command line, as ``LLM(model, **options)`` keywords."""
    return {f.name: getattr(args, f.name) for f in engine_options() if hasattr(args, f.name)}

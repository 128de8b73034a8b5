"""The V4 output parser as the server and the encoding build it: the Python parser, with the C
front (``_quiet.c``, through :mod:`.native`) before it where that builds."""

from __future__ import annotations

from deepinfer_core.codecs import OutputParser

from . import native
from .dsml import V4_TAGS, DsmlTags
from .parser import NOTHING, DeepSeekV4Parser


def new_parser(
    *,
    thinking: bool = True,
    tags: DsmlTags = V4_TAGS,
    stop: tuple[str, ...] = (),
    accelerate: bool | None = None,
    stream_calls: bool = False,
) -> OutputParser:
    """A V4 parser; ``accelerate`` (None: unless ``DEEPINFER_NATIVE_PARSER=0``) puts the C front
    before it where that builds. The front is its own type so that CPython's specialized method
    call reaches its ``push`` (a Python subclass of a C type loses that), and it hands every
    piece it does not store to the parser."""
    parser = DeepSeekV4Parser(thinking=thinking, tags=tags, stop=stop, stream_calls=stream_calls)
    if stream_calls:  # every piece is read (streamed): nothing for the front to store
        return parser
    module = native.load().module if (native.enabled() if accelerate is None else accelerate) else None
    if module is None:
        return parser
    parser._front = module.Front(parser, NOTHING)
    return parser._front

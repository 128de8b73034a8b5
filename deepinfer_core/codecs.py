"""Protocol codecs, prompt encodings and output parsers (the "recipe" side of the engine).

* A :class:`ProtocolCodec` speaks one HTTP API (OpenAI Chat Completions, Anthropic Messages...):
  it parses a request body into a :class:`ConversationRequest` and renders results, stream
  events and errors back in that API's own format.
* A :class:`PromptEncoding` turns a conversation into token ids for one model family.
* An :class:`OutputParser` turns generated text back into reasoning / content / tool calls,
  incrementally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

__all__ = [
    "ConversationRequest",
    "EncodedPrompt",
    "Message",
    "OutputParser",
    "OutputParserFactory",
    "ParsedOutput",
    "PromptEncoding",
    "PromptEncodingFactory",
    "ProtocolCodec",
    "ProtocolCodecFactory",
    "ProtocolError",
    "ToolCall",
    "ToolCallDelta",
]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a tool call still being written, for streams (additive; a parser may or may not
    emit them). A call's first delta has its ``id`` and ``name``; the next ones (same ``id``)
    carry pieces of its arguments text. The whole :class:`ToolCall` still follows in
    ``ParsedOutput.tool_calls`` once the call is complete, with the same id and arguments equal
    to the pieces joined: a codec that streamed the deltas then only closes the call. A call
    whose deltas began but that never completes (cut by the output limit) is closed by the
    codec at the end of the stream with what it has."""

    id: str
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool | developer
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    # Additive (recipe plugin): tools / response format attached to this very message, for
    # prompt formats that render them inside a particular turn (DeepSeek V4 renders a
    # developer message's tools in that user turn). Request-level ``tools`` stay the usual way.
    tools: tuple[dict, ...] = ()
    response_format: dict | None = None
    # Additive: model-family specific per-message fields a codec passed through (e.g. DeepSeek's
    # ``task``); encodings ignore keys they do not know.
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ConversationRequest:
    """A protocol-neutral request: what every codec parses into."""

    messages: tuple[Message, ...]
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    tools: tuple[dict, ...] = ()
    tool_choice: Any = None
    thinking: bool | None = None
    reasoning_effort: str | None = None
    response_format: dict | None = None
    seed: int | None = None
    extra: dict = field(default_factory=dict)
    # Additive: the request field that set max_tokens, named in errors (Chat's
    # max_completion_tokens, Responses' max_output_tokens)
    max_tokens_param: str = "max_tokens"


@dataclass(frozen=True)
class ParsedOutput:
    """What an output parser makes of (part of) the generated text."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    # Additive: set by the engine on the last event of a stream (parsers leave them None), so
    # that ``ProtocolCodec.stream`` can emit the protocol's final frame with reason and usage.
    finish_reason: str | None = None
    usage: dict | None = None
    # Additive: the stop sequence that ended the output (finish reason ``stop_sequence``), which
    # Anthropic's ``stop_sequence`` field names.
    stop_sequence: str | None = None
    # Additive: tool calls streamed piece by piece before they complete (see ToolCallDelta).
    tool_call_deltas: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class EncodedPrompt:
    token_ids: tuple[int, ...]
    stop_token_ids: tuple[int, ...] = ()
    parser_options: dict = field(default_factory=dict)


class ProtocolError(Exception):
    """A request the protocol rejects; codecs render it in their own error format."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


@runtime_checkable
class OutputParser(Protocol):
    def push(self, text: str) -> ParsedOutput:
        """Feed newly generated text; return the part that became final (deltas)."""
        ...

    def finish(self) -> ParsedOutput:
        """End of generation: flush whatever was held back."""
        ...


@runtime_checkable
class PromptEncoding(Protocol):
    """May also define ``warm_up() -> str`` (optional): work its first request would wait for,
    which ``deepinfer serve`` runs in the background at start-up and logs (what it returns)."""

    name: str

    def matches(self, model_config: dict) -> bool:
        """True if this encoding is the right one for a model with this (HF-style) config."""
        ...

    def encode(self, conversation: ConversationRequest) -> EncodedPrompt: ...

    def parser(self, options: dict | None = None) -> OutputParser: ...


@runtime_checkable
class ProtocolCodec(Protocol):
    name: str
    routes: Sequence[tuple[str, str]]  # (HTTP method, path)

    def parse_request(self, body: dict) -> ConversationRequest:
        """Validate and convert; raise :class:`ProtocolError` on bad input."""
        ...

    def render(self, request: ConversationRequest, result: ParsedOutput, usage: dict, finish_reason: str) -> dict: ...

    def stream(self, request: ConversationRequest, events: Iterable[ParsedOutput]) -> Iterable[str]:
        """Server-sent-event frames for a stream of deltas."""
        ...

    def render_error(self, error: ProtocolError) -> tuple[int, dict]:
        """(HTTP status, body) in the protocol's own error format."""
        ...


ProtocolCodecFactory = Callable[[], ProtocolCodec]
PromptEncodingFactory = Callable[[], PromptEncoding]
OutputParserFactory = Callable[[dict], OutputParser]

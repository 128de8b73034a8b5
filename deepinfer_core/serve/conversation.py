"""Conversation -> (token ids, sampling parameters, output parser) for one engine.

The prompt comes from the first registered :class:`PromptEncoding` whose ``matches`` accepts the
model's config (DeepSeek V4 through the recipe plugin), else from the model's own chat template.
A model without a native tool-call format (a chat-template model) still answers forced tool
calls (``tool_choice`` ``required`` or a named function): the call is generated under a JSON
grammar ``{"name": ..., "arguments": {...}}`` and parsed back into a tool call, the approach
vLLM takes for forced tool choice. Output limits default by mode (8,192 tokens, 65,536 with
thinking, 131,072 at max effort), capped by what the context and the KV cache leave.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Callable

from ..chat_prompt import check_conversation, encode_chat
from ..codecs import ConversationRequest, Message, OutputParser, ParsedOutput, ProtocolError, ToolCall
from ..engine.sampling_params import SamplingParams
from .grammar import GrammarCompiler

DEFAULT_MAX_TOKENS = 8192
THINKING_MAX_TOKENS = 65536
MAX_EFFORT_MAX_TOKENS = 131072


@dataclass(frozen=True)
class PreparedRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    new_parser: Callable[[], OutputParser]
    thinking: bool = False


class PlainTextParser:
    """Everything is answer text (models without reasoning or tool-call markup)."""

    def push(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text)

    def finish(self) -> ParsedOutput:
        return ParsedOutput()


class ToolCallJsonParser:
    """Output generated under the forced-tool-call grammar: one ``{"name", "arguments"}``
    object, emitted as a tool call when generation ends."""

    def __init__(self) -> None:
        self._text = ""

    def push(self, text: str) -> ParsedOutput:
        self._text += text
        return ParsedOutput()

    def finish(self) -> ParsedOutput:
        try:
            value = json.loads(self._text)
            call = ToolCall(name=value["name"], arguments=json.dumps(value["arguments"], ensure_ascii=False), id="call_" + secrets.token_hex(12))
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: give the text back
            return ParsedOutput(content=self._text)
        return ParsedOutput(tool_calls=(call,))


def forced_tool_schema(request: ConversationRequest) -> dict | None:
    """The JSON schema of a forced tool call, or None when the tool choice forces nothing."""
    choice = request.tool_choice
    if not request.tools or choice in (None, "auto", "none"):
        return None
    functions = [t["function"] for t in request.tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ProtocolError(f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _template_messages(request: ConversationRequest, forced: bool) -> list[dict]:
    """Messages for a Hugging Face chat template; tool calls are written as the JSON the
    forced-call grammar produces, so a tool-result round trip reads naturally."""
    messages = []
    for m in request.messages:
        role = "system" if m.role == "developer" else m.role
        content = m.content
        if m.tool_calls:
            calls = "\n".join(json.dumps({"name": c.name, "arguments": json.loads(c.arguments or "{}")}, ensure_ascii=False) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        entry = {"role": role, "content": content}
        if m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
        messages.append(entry)
    if request.tools and request.tool_choice != "none":
        listing = json.dumps([t["function"] for t in request.tools], ensure_ascii=False)
        note = f"You can call these tools: {listing}\n" + ('To call one, answer with JSON {"name": ..., "arguments": {...}}.' if forced else "")
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}
        else:
            messages.insert(0, {"role": "system", "content": note})
    return messages


class ConversationPreparer:
    """Everything the server needs to know about the model to turn requests into work."""

    def __init__(self, engine, host) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.encoding = None
        config = engine.model.config if isinstance(engine.model.config, dict) else {}
        for factory in host.prompt_encodings().values():
            encoding = factory()
            if encoding.matches(config):
                self.encoding = encoding
                break
        self.parsers = host.output_parsers()
        self._grammar: GrammarCompiler | None = None

    @property
    def grammar(self) -> GrammarCompiler:
        if self._grammar is None:  # xgrammar's vocabulary scan costs ~1 s: only when needed
            eos = tuple(self.tokenizer.stop_token_ids) if self.tokenizer is not None else ()
            self._grammar = GrammarCompiler(self.tokenizer, self.engine.model.vocab_size, eos)
        return self._grammar

    # -- prompt -----------------------------------------------------------------------------
    def encode(self, request: ConversationRequest) -> tuple[list[int], Callable[[], OutputParser], bool, tuple[int, ...]]:
        """(token ids, parser factory, thinking, extra stop ids)."""
        forced = forced_tool_schema(request) is not None
        if "prompt" in request.extra:  # /v1/completions: a raw prompt
            prompt = request.extra["prompt"]
            if isinstance(prompt, list):
                return list(prompt), PlainTextParser, False, ()
            self._check_text(prompt, "prompt")
            return self._tokenizer_or_fail().encode(prompt, add_special_tokens=True), PlainTextParser, False, ()
        if self.encoding is not None:
            encoded = self.encoding.encode(request)
            options = dict(encoded.parser_options)
            factory = self.parsers.get(options.get("parser", ""))
            new_parser = (lambda: factory(options)) if factory is not None else (lambda: self.encoding.parser(options))
            return list(encoded.token_ids), new_parser, bool(options.get("thinking")), tuple(encoded.stop_token_ids)
        tok = self._tokenizer_or_fail()
        try:  # special tokens only where the template puts them: message text stays text
            conversation = check_conversation(_template_messages(request, forced))
            self._check_text("".join(m["content"] for m in conversation), "messages")
            ids, _ = encode_chat(tok, conversation, add_generation_prompt=True)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"messages: {exc}", param="messages") from None
        return ids, (ToolCallJsonParser if forced else PlainTextParser), False, ()

    def _check_text(self, text: str, param: str) -> None:
        """Text the tokenizer cannot take (lone surrogates), or surely too long for the context
        (the engine's check, before tokenizing megabytes), is the client's error."""
        try:
            text.encode("utf-8")
        except UnicodeError as exc:
            raise ProtocolError(f"{param}: the text is not valid Unicode ({exc.reason} at {exc.start})", param=param) from None
        check = getattr(self.engine, "check_prompt_text", None)
        try:
            if check is not None:
                check(text)
        except ValueError as exc:
            raise ProtocolError(f"{param}: {exc}", param=param, code="context_length_exceeded") from None

    def _tokenizer_or_fail(self):
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send token ids to /v1/completions", param="messages")
        return self.tokenizer

    # -- sampling ---------------------------------------------------------------------------
    def prepare(self, request: ConversationRequest) -> PreparedRequest:
        ids, new_parser, thinking, stop_ids = self.encode(request)
        n, context = len(ids), self.engine.max_model_len
        if n >= context:
            raise ProtocolError(
                f"the prompt has {n} tokens but the model's context is {context} tokens: shorten the messages",
                param="messages", code="context_length_exceeded",
            )
        kv_room = self.engine.num_blocks * self.engine.config.block_size - n
        if request.max_tokens is not None:
            max_tokens = request.max_tokens
        else:
            default = MAX_EFFORT_MAX_TOKENS if request.reasoning_effort == "max" else THINKING_MAX_TOKENS if thinking else DEFAULT_MAX_TOKENS
            max_tokens = max(1, min(default, context - n, kv_room))
        processors = self._processors(request)
        extra = request.extra
        uses_native_parser = self.encoding is not None
        try:
            params = SamplingParams(
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if not request.top_p else request.top_p,
                top_k=int(extra.get("top_k", 0)),
                presence_penalty=float(extra.get("presence_penalty", 0.0)),
                frequency_penalty=float(extra.get("frequency_penalty", 0.0)),
                seed=request.seed,
                max_tokens=max_tokens,
                stop=None if uses_native_parser else list(request.stop),  # V4's parser applies stops to the answer only
                stop_token_ids=list(stop_ids),
                ignore_eos=bool(extra.get("ignore_eos", False)),
                logits_processors=processors,
            )
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        return PreparedRequest(tuple(ids), params, new_parser, thinking)

    def _processors(self, request: ConversationRequest) -> list:
        if self.encoding is None and (schema := forced_tool_schema(request)) is not None:
            return [self.grammar.json_schema(schema, "tools")]
        fmt = request.response_format
        if not fmt or fmt.get("type") == "text":
            return []
        if self.tokenizer is None:
            raise ProtocolError("response_format needs a tokenizer, and this model has none", param="response_format")
        if fmt["type"] == "json_object":
            return [self.grammar.json_object()]
        return [self.grammar.json_schema(fmt["json_schema"].get("schema", {}), "response_format.json_schema.schema")]

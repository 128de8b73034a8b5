"""Conversation -> (token ids, sampling parameters, output parser) for one engine.

The prompt comes from the first registered :class:`PromptEncoding` whose ``matches`` accepts the
model's config (DeepSeek V4 through the recipe plugin), else from the model's own chat template.
A model without a native tool-call format (a chat-template model) calls tools in the
Hermes syntax, under an xgrammar structural tag once a call starts (:mod:`.tool_calls`). Output
limits default by mode (8,192 tokens, 65,536 with thinking, 131,072 at max effort), capped by
what the context and the KV cache leave; an explicit limit that the prompt leaves no room for is
refused (400, ``context_length_exceeded``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..chat_prompt import check_conversation, encode_chat
from ..codecs import ConversationRequest, OutputParser, ParsedOutput, ProtocolError
from ..engine.sampling_params import SamplingParams
from ..engine.validation import context_overflow_message
from .grammar import GrammarCompiler
from .sampling_defaults import SamplingDefaults
from .tool_calls import (
    FirstCallOnly,
    HermesToolParser,
    single_call,
    template_messages,
    template_renders_tools,
    tool_call_tag,
    tools_active,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 8192
THINKING_MAX_TOKENS = 65536
MAX_EFFORT_MAX_TOKENS = 131072


@dataclass(frozen=True)
class PreparedRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    new_parser: Callable[[], OutputParser]
    thinking: bool = False
    # the output parser, not the engine, ends this request (V4 applies stop sequences to the
    # answer only; FirstCallOnly ends it at its first tool call): a non-streamed request is
    # parsed as it goes, so it ends there, not at max_tokens
    parser_stops: bool = False


class PlainTextParser:
    """Everything is answer text (models without reasoning or tool-call markup)."""

    def push(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text)

    def finish(self) -> ParsedOutput:
        return ParsedOutput()


class ConversationPreparer:
    """Everything the server needs to know about the model to turn requests into work."""

    def __init__(self, engine, host, defaults: SamplingDefaults | None = None) -> None:
        self.engine = engine
        self.defaults = defaults or SamplingDefaults()  # for fields a request leaves unset
        self.tokenizer = engine.tokenizer
        self.encoding = None
        config = engine.model.config if isinstance(engine.model.config, dict) else {}
        for factory in host.prompt_encodings().values():
            encoding = factory()
            if encoding.matches(config):
                self.encoding = encoding
                break
        self.parsers = host.output_parsers()
        self.native_tools = self.tokenizer is not None and template_renders_tools(self.tokenizer.chat_template)
        self._grammar: GrammarCompiler | None = None

    def start_warm_up(self) -> threading.Thread | None:
        """Run the prompt encoding's optional ``warm_up()`` (DeepSeek-V4: tokenizer load, the
        parser's C front compiled) in a background thread at server start-up, so the first
        request does not pay for it; logged, never fatal (a request would do the same work)."""
        warm_up = getattr(self.encoding, "warm_up", None)
        if warm_up is None:
            return None

        def run() -> None:
            start = time.monotonic()
            try:
                said = warm_up()
            except Exception as exc:  # the first request will try again and report it
                log.warning(
                    "warming up the %s prompt encoding failed: %s: %s", self.encoding.name, type(exc).__name__, exc
                )
                return
            log.info("%s prompt encoding warmed up in %.2f s: %s", self.encoding.name, time.monotonic() - start, said)

        thread = threading.Thread(target=run, name="deepinfer-warm-up", daemon=True)
        thread.start()
        return thread

    @property
    def grammar(self) -> GrammarCompiler:
        if self._grammar is None:  # xgrammar's vocabulary scan costs ~1 s: only when needed
            eos = tuple(self.tokenizer.stop_token_ids) if self.tokenizer is not None else ()
            self._grammar = GrammarCompiler(self.tokenizer, self.engine.model.vocab_size, eos)
        return self._grammar

    # -- prompt -----------------------------------------------------------------------------
    def encode(
        self, request: ConversationRequest
    ) -> tuple[list[int], Callable[[], OutputParser], bool, tuple[int, ...]]:
        """(token ids, parser factory, thinking, extra stop ids)."""
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
            messages, variables = template_messages(request, native=self.native_tools)
            conversation = check_conversation(messages)
            self._check_text("".join(m["content"] for m in conversation), "messages")
            ids, _ = encode_chat(tok, conversation, add_generation_prompt=True, **variables)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"messages: {exc}", param="messages") from None
        return ids, (HermesToolParser if tools_active(request) else PlainTextParser), False, ()

    def _check_text(self, text: str, param: str) -> None:
        """Text the tokenizer cannot take (lone surrogates), or surely too long for the context
        (the engine's check, before tokenizing megabytes), is the client's error."""
        try:
            text.encode("utf-8")
        except UnicodeError as exc:
            raise ProtocolError(
                f"{param}: the text is not valid Unicode ({exc.reason} at {exc.start})", param=param
            ) from None
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
        one_call = single_call(request)
        if one_call:
            new_parser = _first_call_only(new_parser)
        n, context = len(ids), self.engine.max_model_len
        if n >= context:
            raise ProtocolError(
                f"the prompt has {n} tokens but the model's context is {context} tokens: shorten the messages",
                param="messages",
                code="context_length_exceeded",
            )
        kv_room = self.engine.num_blocks * self.engine.config.block_size - n
        if request.max_tokens is not None and n + request.max_tokens > context:  # refused, as OpenAI and Anthropic do
            param = request.max_tokens_param
            raise ProtocolError(
                context_overflow_message(param, n, request.max_tokens, context),
                param=param,
                code="context_length_exceeded",
            )
        if request.max_tokens is not None:
            max_tokens = request.max_tokens
        else:
            default = (
                MAX_EFFORT_MAX_TOKENS
                if request.reasoning_effort == "max"
                else THINKING_MAX_TOKENS
                if thinking
                else DEFAULT_MAX_TOKENS
            )
            max_tokens = max(1, min(default, context - n, kv_room))
        processors = self._processors(request)
        extra = request.extra
        uses_native_parser = self.encoding is not None
        try:
            params = SamplingParams(
                temperature=self.defaults.temperature if request.temperature is None else request.temperature,
                top_p=self.defaults.top_p if request.top_p is None else request.top_p or 1.0,
                top_k=int(extra["top_k"]) if extra.get("top_k") is not None else self.defaults.top_k,
                min_p=float(extra.get("min_p", 0.0)),
                repetition_penalty=float(extra.get("repetition_penalty", 1.0)),
                presence_penalty=float(extra.get("presence_penalty", 0.0)),
                frequency_penalty=float(extra.get("frequency_penalty", 0.0)),
                seed=request.seed,
                max_tokens=max_tokens,
                stop=None if uses_native_parser else list(request.stop),  # V4's parser applies stops to the answer only
                stop_token_ids=list(stop_ids),
                ignore_eos=bool(extra.get("ignore_eos", False)),
                min_tokens=int(extra.get("min_tokens", 0)),
                logits_processors=processors,
            )
        except (ValueError, TypeError) as exc:  # "invalid sampling parameter NAME=...": name the field
            field = re.match(r"invalid sampling parameter (\w+)=", str(exc))
            raise ProtocolError(str(exc), param=field.group(1) if field else None) from None
        return PreparedRequest(
            tuple(ids),
            params,
            new_parser,
            thinking,
            parser_stops=one_call or (uses_native_parser and bool(request.stop)),
        )

    def _processors(self, request: ConversationRequest) -> list:
        bias = request.extra.get("logit_bias")
        if not bias:
            return self._constraints(request)
        vocab = self.engine.model.vocab_size
        if (bad := next((t for t in bias if not 0 <= t < vocab), None)) is not None:
            raise ProtocolError(
                f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})", param="logit_bias"
            )
        return [logit_bias_processor(bias), *self._constraints(request)]

    def _constraints(self, request: ConversationRequest) -> list:
        if self.encoding is None and self.tokenizer is not None and tools_active(request):
            try:
                tag = tool_call_tag(request, self.grammar.compiles)
            except ValueError as exc:  # xgrammar's pydantic models refuse a tool
                raise ProtocolError(f"tools: {exc}", param="tools") from None
            return [self.grammar.structural_tag(tag, "tools")]
        fmt = request.response_format
        if not fmt or fmt.get("type") == "text":
            return []
        if self.tokenizer is None:
            raise ProtocolError("response_format needs a tokenizer, and this model has none", param="response_format")
        if fmt["type"] == "json_object":
            return [self.grammar.json_object()]
        return [self.grammar.json_schema(fmt["json_schema"].get("schema", {}), "response_format.json_schema.schema")]


def logit_bias_processor(bias: dict[int, float]) -> Callable:
    """OpenAI's ``logit_bias``: each bias added to its token's logit before sampling (a mask
    applied after it still wins: -inf plus a bias is -inf)."""
    import torch

    ids = torch.tensor(list(bias), dtype=torch.long)
    values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def process(output_token_ids, logits):  # logits [V]
        return logits.index_add(0, ids.to(logits.device), values.to(logits.device, logits.dtype))

    return process


def _first_call_only(new_parser: Callable[[], OutputParser]) -> Callable[[], OutputParser]:
    return lambda: FirstCallOnly(new_parser())

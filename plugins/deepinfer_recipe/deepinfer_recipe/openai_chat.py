"""OpenAI Chat Completions codec (``POST /v1/chat/completions``).

Request extensions DeepSeek's API adds and we accept (and vLLM's ``min_tokens``): ``thinking: {"type": "enabled" |
"disabled"}``, ``reasoning_effort`` up to ``max``, ``reasoning_content`` on assistant messages
(and in our responses, as DeepSeek returns it). Effort names are normalized to the model's
levels here (``minimal``/``low`` -> low, ``medium``/``high``/``xhigh`` -> high, ``max``;
``none`` turns thinking off), so encodings only ever see ``low | high | max``.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

from deepinfer_core.codecs import ConversationRequest, Message, ParsedOutput, ProtocolError, ToolCall

from . import validation as v
from .common import EFFORT_NAMES, effort_level, openai_finish_reason, parse_function_tools, sse_data

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(content, param: str, *, allow_none: bool, separator: str = "") -> str:
    """String content, or the text parts of a content-part array (others are rejected:
    DeepSeek V4 is a text model). A tool result's parts are joined by a blank line, as
    DeepSeek's reference encoder joins them."""
    if content is None:
        if allow_none:
            return ""
        raise v.fail(param, "is required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise v.fail(param, "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "refusal"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise v.fail(f"{param}[{j}]", f"unsupported content part {kind!r} (only text)")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise v.fail(f"{param}[{j}].text", "must be a string")
        texts.append(text)
    return separator.join(texts)


def _tool_calls(raw, param: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise v.fail(param, "must be an array")
    calls = []
    for j, call in enumerate(raw):
        where = f"{param}[{j}]"
        v.require_object(call, where)
        function = v.require_object(call.get("function"), f"{where}.function")
        name = v.get_str(function, "name", required=True, param=f"{where}.function.name")
        arguments = v.get_str(function, "arguments", param=f"{where}.function.arguments")
        arguments = "{}" if arguments is None else v.arguments_text(arguments, f"{where}.function.arguments")
        call_id = v.get_str(call, "id", param=f"{where}.id") or ""
        calls.append(ToolCall(name=name, arguments=arguments, id=call_id))
    return tuple(calls)


def _message(raw, i: int, last: bool) -> Message:
    where = f"messages[{i}]"
    v.require_object(raw, where)
    role = v.get_choice(raw, "role", ROLES, param=f"{where}.role")
    if role is None:
        raise v.fail(f"{where}.role", "is required")
    name = v.get_str(raw, "name", param=f"{where}.name")
    if role == "assistant":
        calls = _tool_calls(raw.get("tool_calls"), f"{where}.tool_calls")
        content = _content_text(raw.get("content"), f"{where}.content", allow_none=True)
        reasoning = v.get_str(raw, "reasoning_content", param=f"{where}.reasoning_content")
        # DeepSeek's chat prefix completion: the last assistant message is continued, not closed
        prefix = v.get_bool(raw, "prefix", param=f"{where}.prefix")
        if prefix and not last:
            raise v.fail(f"{where}.prefix", "only the last message can be a prefix to continue")
        extra = {"wo_eos": True} if prefix else {}
        return Message(role=role, content=content, reasoning=reasoning, tool_calls=calls, name=name, extra=extra)
    separator = "\n\n" if role == "tool" else ""
    content = _content_text(raw.get("content"), f"{where}.content", allow_none=False, separator=separator)
    if role == "tool":
        call_id = v.get_str(raw, "tool_call_id", required=True, param=f"{where}.tool_call_id")
        return Message(role=role, content=content, tool_call_id=call_id)
    return Message(role=role, content=content, name=name)


def _tool_choice(raw):
    if raw is None or raw in ("none", "auto", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        if isinstance(raw["function"].get("name"), str):
            return raw
    raise v.fail("tool_choice", "must be 'none', 'auto', 'required' or {type: function, function: {name}}")


def _response_format(raw) -> dict | None:
    if raw is None:
        return None
    v.require_object(raw, "response_format")
    kind = v.get_choice(raw, "type", ("text", "json_object", "json_schema"), param="response_format.type")
    if kind is None:
        raise v.fail("response_format.type", "is required")
    if kind == "json_schema":
        schema = v.require_object(raw.get("json_schema"), "response_format.json_schema")
        v.get_str(schema, "name", required=True, param="response_format.json_schema.name")
    return raw


def _thinking(body: dict) -> tuple[bool | None, str | None]:
    thinking = None
    raw = body.get("thinking")
    if raw is not None:
        v.require_object(raw, "thinking")
        thinking = (
            v.get_choice(raw, "type", ("enabled", "disabled"), param="thinking.type", required=True) != "disabled"
        )
    effort = v.get_choice(body, "reasoning_effort", EFFORT_NAMES + ("none",))
    if effort == "none":
        return False, None
    return thinking, effort_level(effort)


class OpenAIChatCodec:
    name = "openai.chat_completions"
    routes = (("POST", "/v1/chat/completions"),)

    def parse_request(self, body: dict) -> ConversationRequest:
        v.check_request(body)
        model = v.get_str(body, "model", required=True)
        raw_messages = v.get_list(body, "messages", required=True, non_empty=True)
        messages = tuple(_message(m, i, i == len(raw_messages) - 1) for i, m in enumerate(raw_messages))
        max_tokens = v.get_int(body, "max_completion_tokens", lo=1)
        legacy_max = v.get_int(body, "max_tokens", lo=1)
        if v.get_int(body, "n", lo=1) not in (None, 1):
            raise v.fail("n", "only n=1 is supported")
        if v.get_bool(body, "logprobs"):  # refused, not silently answered without them
            raise v.fail("logprobs", "is not supported (this server returns no log probabilities)")
        if v.get_int(body, "top_logprobs", lo=0) not in (None, 0):
            raise v.fail("top_logprobs", "is not supported (this server returns no log probabilities)")
        thinking, effort = _thinking(body)
        extra = {}
        for key in ("presence_penalty", "frequency_penalty"):
            if (value := v.get_number(body, key, -2, 2)) is not None:
                extra[key] = value
        if (min_tokens := v.get_int(body, "min_tokens", lo=0)) is not None:  # vLLM's extension
            extra["min_tokens"] = min_tokens
        v.sampling_extensions(body, extra)
        if (options := body.get("stream_options")) is not None:
            extra["stream_options"] = v.require_object(options, "stream_options")
        if (user := v.get_str(body, "user")) is not None:
            extra["user"] = user
        if body.get("parallel_tool_calls") is not None:
            extra["parallel_tool_calls"] = v.get_bool(body, "parallel_tool_calls")
        return ConversationRequest(
            messages=messages,
            model=model,
            max_tokens=max_tokens if max_tokens is not None else legacy_max,
            max_tokens_param="max_completion_tokens" if max_tokens is not None else "max_tokens",
            temperature=v.get_number(body, "temperature", 0, 2),
            top_p=v.get_number(body, "top_p", 0, 1),
            stop=v.stop_list(body.get("stop"), "stop", limit=4),
            stream=v.get_bool(body, "stream"),
            tools=parse_function_tools(v.get_list(body, "tools") or [], "tools"),
            tool_choice=_tool_choice(body.get("tool_choice")),
            thinking=thinking,
            reasoning_effort=effort,
            response_format=_response_format(body.get("response_format")),
            seed=v.get_int(body, "seed"),
            extra=extra,
        )

    # -- responses --------------------------------------------------------------------------
    def _tool_call_json(self, call: ToolCall, index: int | None = None) -> dict:
        out = {
            "id": call.id or v.new_id("call_"),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        return out if index is None else {"index": index, **out}

    def _usage(self, usage: dict) -> dict:
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if "cached_tokens" in usage:
            out["prompt_tokens_details"] = {"cached_tokens": int(usage["cached_tokens"])}
        if "reasoning_tokens" in usage:
            out["completion_tokens_details"] = {"reasoning_tokens": int(usage["reasoning_tokens"])}
        return out

    def render(self, request: ConversationRequest, result: ParsedOutput, usage: dict, finish_reason: str) -> dict:
        message: dict = {
            "role": "assistant",
            "content": result.content if (result.content or not result.tool_calls) else None,
        }
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["tool_calls"] = [self._tool_call_json(c) for c in result.tool_calls]
        return {
            "id": request.extra.get("request_id") or v.new_id("chatcmpl-"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": openai_finish_reason(finish_reason, bool(result.tool_calls)),
                }
            ],
            "usage": self._usage(usage),
        }

    def stream(self, request: ConversationRequest, events: Iterable[ParsedOutput]) -> Iterator[str]:
        """``chat.completion.chunk`` frames, a final chunk with ``finish_reason``, an optional
        usage chunk (``stream_options.include_usage``), then ``data: [DONE]``."""
        base = {
            "id": request.extra.get("request_id") or v.new_id("chatcmpl-"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": request.model,
        }
        include_usage = bool((request.extra.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict, finish: str | None = None) -> str:
            body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            return sse_data(body)

        yield chunk({"role": "assistant", "content": ""})
        calls, finish_reason, usage = 0, "stop", {}
        streamed: dict[str, int] = {}  # id -> index of calls streamed piece by piece
        for event in events:
            if event.reasoning:
                yield chunk({"reasoning_content": event.reasoning})
            if event.content:
                yield chunk({"content": event.content})
            for piece in event.tool_call_deltas:
                if piece.id not in streamed:
                    streamed[piece.id], calls = calls, calls + 1
                    call = {
                        "index": streamed[piece.id],
                        "id": piece.id,
                        "type": "function",
                        "function": {"name": piece.name, "arguments": piece.arguments},
                    }
                elif not piece.arguments:
                    continue
                else:
                    call = {"index": streamed[piece.id], "function": {"arguments": piece.arguments}}
                yield chunk({"tool_calls": [call]})
            for call in event.tool_calls:
                if call.id in streamed:  # its pieces went out already
                    continue
                yield chunk({"tool_calls": [self._tool_call_json(call, calls)]})
                calls += 1
            finish_reason = event.finish_reason or finish_reason
            usage = event.usage if event.usage is not None else usage
        yield chunk({}, openai_finish_reason(finish_reason, calls > 0))
        if include_usage:
            yield sse_data({**base, "choices": [], "usage": self._usage(usage)})
        yield "data: [DONE]\n\n"

    # -- errors -----------------------------------------------------------------------------
    def render_error(self, error: ProtocolError) -> tuple[int, dict]:
        kind = _ERROR_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
        code = error.code if error.code != kind else None
        return error.status, {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}

    def error_frame(self, error: ProtocolError) -> str:
        """An error after streaming began: OpenAI sends the error object as one more data frame."""
        return sse_data(self.render_error(error)[1])


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}

"""OpenAI Responses codec (``POST /v1/responses``), stateless.

``input`` items map onto the conversation: messages by role; ``reasoning`` items become the
next assistant turn's reasoning; ``function_call`` items join the assistant turn they follow
(or open one); ``function_call_output`` items become ``tool`` messages. ``instructions`` is
the system text. ``reasoning.effort`` carries the effort (``none`` = thinking off).
``previous_response_id`` is rejected: nothing is stored server side, send the whole history.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterable, Iterator

from deepinfer_core.codecs import ConversationRequest, Message, ParsedOutput, ProtocolError, ToolCall

from . import validation as v
from .common import EFFORT_NAMES, effort_level, sse_event
from .openai_chat import OpenAIChatCodec
from .openai_responses_stream import ResponseEventStream, output_items


def _parts_text(content, param: str, allowed: tuple[str, ...], separator: str = "") -> str:
    """String content or the allowed parts' text (a tool output's parts joined by a blank line,
    as DeepSeek's reference encoder joins a result's parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise v.fail(param, "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in allowed:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise v.fail(f"{param}[{j}]", f"unsupported content part {kind!r} (only {', '.join(allowed)})")
        texts.append(v.get_str(part, "text", required=True, param=f"{param}[{j}].text"))
    return separator.join(texts)


def _arguments(item: dict, param: str) -> str:
    arguments = v.get_str(item, "arguments", param=param)
    return "{}" if arguments is None else v.arguments_text(arguments, param)


def _input_messages(items: list) -> list[Message]:
    messages: list[Message] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        v.require_object(item, where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = v.get_choice(item, "role", ("user", "assistant", "system", "developer"), param=f"{where}.role")
            if role is None or item.get("content") is None:
                raise v.fail(f"{where}.role" if role is None else f"{where}.content", "is required")
            text = _parts_text(item["content"], f"{where}.content", ("input_text", "output_text", "refusal"))
            messages.append(Message(role=role, content=text, reasoning=reasoning if role == "assistant" else None))
            reasoning = None if role == "assistant" else reasoning
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _parts_text(parts, f"{where}.content", ("reasoning_text", "summary_text"))
        elif kind == "function_call":
            call = ToolCall(
                name=v.get_str(item, "name", required=True, param=f"{where}.name"),
                arguments=_arguments(item, f"{where}.arguments"),
                id=v.get_str(item, "call_id", required=True, param=f"{where}.call_id"),
            )
            if messages and messages[-1].role == "assistant":
                messages[-1] = replace(messages[-1], tool_calls=messages[-1].tool_calls + (call,))
            else:
                messages.append(Message(role="assistant", reasoning=reasoning, tool_calls=(call,)))
                reasoning = None
        elif kind == "function_call_output":
            call_id = v.get_str(item, "call_id", required=True, param=f"{where}.call_id")
            output = item.get("output")
            if output is None:
                raise v.fail(f"{where}.output", "is required")
            messages.append(
                Message(
                    role="tool",
                    tool_call_id=call_id,
                    content=_parts_text(output, f"{where}.output", ("input_text",), "\n\n"),
                )
            )
        else:
            raise v.fail(f"{where}.type", f"unsupported input item {kind!r}")
    return messages


def _tools(raw: list) -> tuple[dict, ...]:
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        v.require_object(tool, where)
        if tool.get("type") != "function":
            raise v.fail(f"{where}.type", "only 'function' tools are supported")
        function = {"name": v.get_str(tool, "name", required=True, param=f"{where}.name")}
        if (description := v.get_str(tool, "description", param=f"{where}.description")) is not None:
            function["description"] = description
        if tool.get("parameters") is not None:
            function["parameters"] = v.require_object(tool["parameters"], f"{where}.parameters")
        if tool.get("strict") is not None:  # arguments constrained to the schema (the server's grammar)
            function["strict"] = v.get_bool(tool, "strict", param=f"{where}.strict")
        tools.append({"type": "function", "function": function})
    return tuple(tools)


def _tool_choice(raw):
    if raw is None or raw in ("none", "auto", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise v.fail("tool_choice", "must be 'none', 'auto', 'required' or {type: function, name}")


def _response_format(text) -> dict | None:
    if text is None:
        return None
    fmt = v.require_object(text, "text").get("format")
    if fmt is None:
        return None
    v.require_object(fmt, "text.format")
    kind = v.get_choice(fmt, "type", ("text", "json_object", "json_schema"), param="text.format.type")
    if kind != "json_schema":
        return {"type": kind} if kind else None
    schema = {
        "name": v.get_str(fmt, "name", required=True, param="text.format.name"),
        "schema": v.require_object(fmt.get("schema"), "text.format.schema"),
    }
    if isinstance(fmt.get("strict"), bool):
        schema["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": schema}


class OpenAIResponsesCodec:
    name = "openai.responses"
    routes = (("POST", "/v1/responses"),)

    def parse_request(self, body: dict) -> ConversationRequest:
        v.check_request(body)
        model = v.get_str(body, "model", required=True)
        if body.get("previous_response_id") is not None:
            raise v.fail(
                "previous_response_id", "is not supported (nothing is stored): send the whole conversation in input"
            )
        if v.get_int(body, "top_logprobs", lo=0) not in (None, 0):  # refused, not silently answered without them
            raise v.fail("top_logprobs", "is not supported (this server returns no log probabilities)")
        raw = body.get("input")
        if raw is None or raw == [] or raw == "":
            raise v.fail("input", "is required and must not be empty")
        if not isinstance(raw, (str, list)):
            raise v.fail("input", "must be a string or an array of input items")
        messages = [Message(role="user", content=raw)] if isinstance(raw, str) else _input_messages(raw)
        if (instructions := v.get_str(body, "instructions")) is not None:
            messages.insert(0, Message(role="system", content=instructions))
        thinking, effort = None, None
        if (reasoning := body.get("reasoning")) is not None:
            name = v.get_choice(
                v.require_object(reasoning, "reasoning"), "effort", EFFORT_NAMES + ("none",), param="reasoning.effort"
            )
            thinking, effort = (False, None) if name == "none" else (None, effort_level(name))
        tools = v.get_list(body, "tools") or []
        extra = {"echo_tools": tools, "echo_tool_choice": body.get("tool_choice", "auto")}
        if (metadata := body.get("metadata")) is not None:
            extra["metadata"] = v.require_object(metadata, "metadata")
        if body.get("parallel_tool_calls") is not None:
            extra["parallel_tool_calls"] = v.get_bool(body, "parallel_tool_calls")
        return ConversationRequest(
            messages=tuple(messages),
            model=model,
            max_tokens=v.get_int(body, "max_output_tokens", lo=1),
            max_tokens_param="max_output_tokens",
            temperature=v.get_number(body, "temperature", 0, 2),
            top_p=v.get_number(body, "top_p", 0, 1),
            stream=v.get_bool(body, "stream"),
            tools=_tools(tools),
            tool_choice=_tool_choice(body.get("tool_choice")),
            thinking=thinking,
            reasoning_effort=effort,
            response_format=_response_format(body.get("text")),
            extra=extra,
        )

    # -- responses --------------------------------------------------------------------------
    def response(
        self, request: ConversationRequest, output: list[dict], usage: dict, finish_reason: str | None, response_id: str
    ) -> dict:
        """The ``response`` object; ``finish_reason`` None means still in progress (stream start)."""
        incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(finish_reason or "")
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": request.model,
            "status": "in_progress" if finish_reason is None else ("incomplete" if incomplete else "completed"),
            "output": output,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "error": None,
            "instructions": None,
            "metadata": request.extra.get("metadata") or {},
            "parallel_tool_calls": True,
            "tool_choice": request.extra.get("echo_tool_choice", "auto"),
            "tools": request.extra.get("echo_tools", []),
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_tokens,
            "usage": None
            if finish_reason is None
            else {
                "input_tokens": prompt,
                "input_tokens_details": {
                    "cached_tokens": int(usage.get("cached_tokens", 0)),
                    "cache_write_tokens": int(usage.get("cache_write_tokens", 0)),
                },
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": int(usage.get("reasoning_tokens", 0))},
                "total_tokens": prompt + completion,
            },
        }

    def render(self, request: ConversationRequest, result: ParsedOutput, usage: dict, finish_reason: str) -> dict:
        response_id = request.extra.get("request_id") or v.new_id("resp_")
        return self.response(request, output_items(result), usage, finish_reason, response_id)

    def stream(self, request: ConversationRequest, events: Iterable[ParsedOutput]) -> Iterator[str]:
        yield from ResponseEventStream(self.response, request).frames(events)

    # -- errors -----------------------------------------------------------------------------
    def render_error(self, error: ProtocolError) -> tuple[int, dict]:
        return OpenAIChatCodec().render_error(error)  # same error envelope across OpenAI APIs

    def error_frame(self, error: ProtocolError) -> str:
        body = self.render_error(error)[1]["error"]
        return sse_event(
            "error",
            {
                "type": "error",
                "code": body["code"],
                "message": body["message"],
                "param": body["param"],
                "sequence_number": 0,
            },
        )

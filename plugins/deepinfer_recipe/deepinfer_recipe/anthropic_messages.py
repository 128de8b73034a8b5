"""Anthropic Messages codec (``POST /v1/messages``).

Mapping onto the protocol-neutral conversation: ``system`` becomes a leading system message;
a user message's blocks become ``tool`` (``tool_result``) and ``user`` (``text``) messages in
block order, which the DeepSeek V4 encoding merges back into one turn (blocks joined by a blank
line, results ordered like the calls, as DeepSeek's reference encoder does); ``tool_use``
blocks become tool calls with their ``input`` as JSON text; ``thinking`` blocks become the
turn's reasoning. A final assistant message is a prefill the model continues (marked
``wo_eos``: its turn is left open). Tools are turned
into OpenAI-style function tools, the form encodings render. Thinking: ``enabled`` /
``adaptive`` -> on, ``disabled`` -> off; ``output_config.effort`` carries the effort.
``tool_choice.disable_parallel_tool_use`` becomes OpenAI's ``parallel_tool_calls`` (negated),
which the server honours for every model: true gives at most one ``tool_use`` block, the
output cut after the first complete call (``deepinfer_core.serve.tool_calls.FirstCallOnly``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Iterable, Iterator

from deepinfer_core.codecs import ConversationRequest, Message, ParsedOutput, ProtocolError, ToolCall

from . import validation as v
from .common import EFFORT_NAMES, anthropic_stop_reason, effort_level, sse_event


def _text_blocks(content, param: str, separator: str = "\n") -> str:
    """A tool result's or system prompt's content: a string or text blocks (a result's blocks
    are joined by a blank line, as DeepSeek's reference encoder joins a result's parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise v.fail(param, "must be a string or an array of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise v.fail(f"{param}[{j}]", "only text blocks are supported here")
        texts.append(block["text"])
    return separator.join(texts)


def _user_messages(content, where: str) -> list[Message]:
    if isinstance(content, str):
        return [Message(role="user", content=content)]
    if not isinstance(content, list):
        raise v.fail(f"{where}.content", "must be a string or an array of content blocks")
    if not content:
        raise v.fail(f"{where}.content", "must hold at least one content block")
    messages = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        v.require_object(block, at)
        kind = block.get("type")
        if kind == "text":
            messages.append(Message(role="user", content=v.get_str(block, "text", required=True, param=f"{at}.text")))
        elif kind == "tool_result":
            call_id = v.get_str(block, "tool_use_id", required=True, param=f"{at}.tool_use_id")
            text = _text_blocks(block.get("content", ""), f"{at}.content", "\n\n")
            messages.append(Message(role="tool", content=text, tool_call_id=call_id))
        else:
            raise v.fail(f"{at}.type", f"unsupported block type {kind!r} in a user message (text, tool_result)")
    return messages


def _assistant_message(content, where: str) -> Message:
    if isinstance(content, str):
        return Message(role="assistant", content=content)
    if not isinstance(content, list):
        raise v.fail(f"{where}.content", "must be a string or an array of content blocks")
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        v.require_object(block, at)
        kind = block.get("type")
        if kind == "text":
            texts.append(v.get_str(block, "text", required=True, param=f"{at}.text"))
        elif kind == "thinking":
            reasoning.append(v.get_str(block, "thinking", required=True, param=f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque to us: nothing to render
        elif kind == "tool_use":
            name = v.get_str(block, "name", required=True, param=f"{at}.name")
            arguments = v.require_object(block.get("input", {}), f"{at}.input")
            call_id = v.get_str(block, "id", param=f"{at}.id") or ""
            calls.append(ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False), id=call_id))
        else:
            raise v.fail(f"{at}.type", f"unsupported block type {kind!r} in an assistant message")
    return Message(
        role="assistant",
        content="".join(texts),
        reasoning="".join(reasoning) if reasoning else None,
        tool_calls=tuple(calls),
    )


def _tools(raw: list) -> tuple[dict, ...]:
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        v.require_object(tool, where)
        if tool.get("type") not in (None, "custom"):
            raise v.fail(f"{where}.type", f"server tool {tool.get('type')!r} is not supported")
        function = {"name": v.get_str(tool, "name", required=True, param=f"{where}.name")}
        if (description := v.get_str(tool, "description", param=f"{where}.description")) is not None:
            function["description"] = description
        function["parameters"] = v.require_object(tool.get("input_schema"), f"{where}.input_schema")
        if tool.get("strict") is not None:  # Anthropic's strict tool use: inputs always match the schema
            function["strict"] = v.get_bool(tool, "strict", param=f"{where}.strict")
        tools.append({"type": "function", "function": function})
    return tuple(tools)


def _tool_choice(raw):
    if raw is None:
        return None
    v.require_object(raw, "tool_choice")
    kind = v.get_choice(raw, "type", ("auto", "any", "tool", "none"), param="tool_choice.type", required=True)
    v.get_bool(raw, "disable_parallel_tool_use", param="tool_choice.disable_parallel_tool_use")
    if kind == "tool":
        name = v.get_str(raw, "name", required=True, param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def _thinking(body: dict, max_tokens: int) -> bool | None:
    raw = body.get("thinking")
    if raw is None:
        return None
    v.require_object(raw, "thinking")
    kind = v.get_choice(raw, "type", ("enabled", "disabled", "adaptive"), param="thinking.type", required=True)
    if kind == "enabled":
        budget = v.get_int(raw, "budget_tokens", lo=1024, required=True)
        if budget >= max_tokens:
            raise v.fail("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens})")
    return kind != "disabled"


class AnthropicMessagesCodec:
    name = "anthropic.messages"
    routes = (("POST", "/v1/messages"),)

    def parse_request(self, body: dict) -> ConversationRequest:
        v.check_request(body)
        model = v.get_str(body, "model", required=True)
        max_tokens = v.get_int(body, "max_tokens", lo=1, required=True)
        raw_messages = v.get_list(body, "messages", required=True, non_empty=True)
        messages: list[Message] = []
        system = body.get("system")
        if system is not None:
            messages.append(Message(role="system", content=_text_blocks(system, "system")))
        for i, raw in enumerate(raw_messages):
            where = f"messages[{i}]"
            v.require_object(raw, where)
            role = v.get_choice(raw, "role", ("user", "assistant"), param=f"{where}.role")
            if role is None:
                raise v.fail(f"{where}.role", "is required")
            if raw.get("content") is None:
                raise v.fail(f"{where}.content", "is required")
            if role == "user":
                messages += _user_messages(raw["content"], where)
            else:
                message = _assistant_message(raw["content"], where)
                if i == len(raw_messages) - 1:
                    message = replace(message, extra={"wo_eos": True})
                messages.append(message)
        extra: dict = {}
        if (top_k := v.get_int(body, "top_k", lo=0)) is not None:
            extra["top_k"] = top_k
        if (metadata := body.get("metadata")) is not None:
            extra["metadata"] = v.require_object(metadata, "metadata")
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is not None:
            # at most one tool_use block: the server's parser cut (serve/tool_calls.FirstCallOnly)
            extra["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
        effort = None
        if (config := body.get("output_config")) is not None:
            effort = v.get_choice(
                v.require_object(config, "output_config"), "effort", EFFORT_NAMES, param="output_config.effort"
            )
        return ConversationRequest(
            messages=tuple(messages),
            model=model,
            max_tokens=max_tokens,
            temperature=v.get_number(body, "temperature", 0, 1),
            top_p=v.get_number(body, "top_p", 0, 1),
            stop=v.stop_list(body.get("stop_sequences"), "stop_sequences", allow_string=False),
            stream=v.get_bool(body, "stream"),
            tools=_tools(v.get_list(body, "tools") or []),
            tool_choice=_tool_choice(body.get("tool_choice")),
            thinking=_thinking(body, max_tokens),
            reasoning_effort=effort_level(effort),
            extra=extra,
        )

    # -- responses --------------------------------------------------------------------------
    @staticmethod
    def _usage(usage: dict) -> dict:
        cached = int(usage.get("cached_tokens", 0))
        out = {
            "input_tokens": max(0, int(usage.get("prompt_tokens", 0)) - cached),
            "output_tokens": int(usage.get("completion_tokens", 0)),
        }
        if "cached_tokens" in usage:
            out["cache_read_input_tokens"] = cached
        return out

    @staticmethod
    def _tool_use(call: ToolCall) -> dict:
        return {
            "type": "tool_use",
            "id": call.id or v.new_id("toolu_"),
            "name": call.name,
            "input": json.loads(call.arguments or "{}"),
        }

    def render(self, request: ConversationRequest, result: ParsedOutput, usage: dict, finish_reason: str) -> dict:
        content: list[dict] = []
        if result.reasoning:
            content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        if result.content:
            content.append({"type": "text", "text": result.content})
        content += [self._tool_use(c) for c in result.tool_calls]
        return {
            "id": request.extra.get("request_id") or v.new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": request.model,
            "content": content,
            "stop_reason": anthropic_stop_reason(finish_reason, bool(result.tool_calls)),
            "stop_sequence": result.stop_sequence if finish_reason == "stop_sequence" else None,
            "usage": self._usage(usage),
        }

    def stream(self, request: ConversationRequest, events: Iterable[ParsedOutput]) -> Iterator[str]:
        """message_start, content blocks (start / deltas / stop), message_delta, message_stop.
        message_start waits for the first event so it can carry the prompt usage, which the
        engine may put on that event."""
        from .anthropic_stream import MessageStream

        yield from MessageStream(request, self._usage, self._tool_use).frames(events)

    # -- errors -----------------------------------------------------------------------------
    def render_error(self, error: ProtocolError) -> tuple[int, dict]:
        kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
        return error.status, {"type": "error", "error": {"type": kind, "message": error.message}}

    def error_frame(self, error: ProtocolError) -> str:
        return sse_event("error", self.render_error(error)[1])


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}

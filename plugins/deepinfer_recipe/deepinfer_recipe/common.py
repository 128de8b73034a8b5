"""Pieces shared by the protocol codecs: effort levels, finish reasons, tool lists, SSE framing.

Finish reasons the engine hands to ``render`` / puts on the last stream event are protocol
neutral: ``stop`` (end of sequence), ``stop_sequence``, ``length``, ``tool_calls``,
``content_filter``. Each codec maps them onto its own vocabulary; a ``stop`` with tool calls
becomes the protocol's tool-use reason.
"""

from __future__ import annotations

import json
from typing import Any

from . import validation as v

#: API effort names -> the model's levels (DeepSeek API, REFERENCE.md section 3).
EFFORT_LEVELS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "high", "max": "max"}
EFFORT_NAMES = tuple(EFFORT_LEVELS)


def effort_level(name: str | None) -> str | None:
    return None if name is None else EFFORT_LEVELS[name]


def openai_finish_reason(reason: str, has_tool_calls: bool) -> str:
    if reason == "length":
        return "length"
    if reason == "content_filter":
        return "content_filter"
    if reason == "tool_calls" or has_tool_calls:
        return "tool_calls"
    return "stop"


def anthropic_stop_reason(reason: str, has_tool_calls: bool) -> str:
    if reason == "length":
        return "max_tokens"
    if reason == "stop_sequence":
        return "stop_sequence"
    if reason == "content_filter":
        return "refusal"
    if reason == "tool_calls" or has_tool_calls:
        return "tool_use"
    return "end_turn"


def parse_function_tools(raw: list, param: str) -> tuple[dict, ...]:
    """OpenAI-style ``[{"type": "function", "function": {name, description?, parameters?}}]``,
    validated and returned as given (the prompt renders each ``function`` object verbatim)."""
    tools = []
    for i, tool in enumerate(raw):
        where = f"{param}[{i}]"
        v.require_object(tool, where)
        if tool.get("type") != "function":
            raise v.fail(f"{where}.type", "only 'function' tools are supported")
        function = v.require_object(tool.get("function"), f"{where}.function")
        v.get_str(function, "name", required=True, param=f"{where}.function.name")
        v.get_str(function, "description", param=f"{where}.function.description")
        if function.get("parameters") is not None:
            v.require_object(function["parameters"], f"{where}.function.parameters")
        v.get_bool(function, "strict", param=f"{where}.function.strict")
        tools.append(tool)
    return tuple(tools)


def sse_data(payload: Any) -> str:
    """One ``data:`` frame (OpenAI style: no event name)."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_event(event: str, payload: Any) -> str:
    """One named frame (Anthropic style: ``event:`` line plus ``data:``)."""
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

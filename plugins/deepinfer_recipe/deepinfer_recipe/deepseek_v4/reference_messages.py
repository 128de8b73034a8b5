"""Convert DeepSeek-reference-style message dicts into core :class:`Message` objects.

DeepSeek's reference encoder takes OpenAI-like dicts with a few extensions: ``tools`` /
``response_format`` on a system or developer message, ``reasoning_content`` on assistant
messages, the ``latest_reminder`` role and a per-message ``task``. The golden vectors are written
in that form; this converter lets them (and offline tooling) drive the encoding directly. HTTP
requests go through the protocol codecs instead, which validate their own formats.
"""
from __future__ import annotations

from typing import Any, Iterable

from deepinfer_core.codecs import ConversationRequest, Message, ToolCall

_KNOWN_KEYS = {"role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name", "tools", "response_format"}


def _text(content: Any, *, tool_result: bool = False) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [part for part in content if isinstance(part, dict)]
    if tool_result:  # the reference joins a result's parts with blank lines, naming the others
        return "\n\n".join(p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]" for p in parts)
    return "".join(part.get("text", "") for part in parts)


def message_from_reference(raw: dict) -> Message:
    calls = tuple(
        ToolCall(
            name=c["function"]["name"],
            arguments="{}" if c["function"].get("arguments") is None else c["function"]["arguments"],
            id=c.get("id", ""),
        )
        for c in raw.get("tool_calls") or ()
    )
    return Message(
        role=raw["role"],
        content=_text(raw.get("content"), tool_result=raw["role"] == "tool"),
        reasoning=raw.get("reasoning_content"),
        tool_calls=calls,
        tool_call_id=raw.get("tool_call_id"),
        name=raw.get("name"),
        tools=tuple(raw.get("tools") or ()),
        response_format=raw.get("response_format"),
        extra={k: v for k, v in raw.items() if k not in _KNOWN_KEYS},
    )


def conversation_from_reference(
    messages: Iterable[dict], *, thinking_mode: str = "thinking", reasoning_effort: str | None = None
) -> ConversationRequest:
    """``thinking_mode`` is the reference encoder's ``"thinking"`` / ``"chat"``."""
    if thinking_mode not in ("thinking", "chat"):
        raise ValueError(f"thinking_mode must be 'thinking' or 'chat', got {thinking_mode!r}")
    return ConversationRequest(
        messages=tuple(message_from_reference(m) for m in messages),
        thinking=thinking_mode == "thinking",
        reasoning_effort=reasoning_effort,
    )

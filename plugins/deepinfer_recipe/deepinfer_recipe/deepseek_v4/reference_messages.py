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


def _text(content: Any, where: str, *, tool_result: bool = False) -> str:
    """Message text; anything but a string, a list of part objects or None is refused (the
    reference would render Python's ``str()`` of it, e.g. ``{'a': 1}``, or raise)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string, a list of content parts or null, got {type(content).__name__}")
    parts = list(content)
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
            raise ValueError(f"{where}[{j}] must be a content part object with string text, got {part!r:.80}")
    if tool_result:  # the reference joins a result's parts with blank lines, naming the others
        return "\n\n".join(
            p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]" for p in parts
        )
    return "".join(part.get("text", "") for part in parts)


def _call(raw: Any, where: str) -> ToolCall:
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'function': {{'name': str, 'arguments': str}}}}, got {raw!r:.80}")
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments must be a JSON text (a string), got {type(arguments).__name__}")
    # null arguments render as no parameters (the reference renders a parameter "arguments" = null)
    return ToolCall(name=function["name"], arguments="{}" if arguments is None else arguments, id=raw.get("id") or "")


def message_from_reference(raw: dict, index: int = 0) -> Message:
    where = f"messages[{index}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise ValueError(f"{where} must be an object with a string 'role', got {raw!r:.80}")
    calls = raw.get("tool_calls") or ()
    if not isinstance(calls, list | tuple):
        raise ValueError(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
    if not isinstance(raw.get("reasoning_content"), str | None):
        raise ValueError(
            f"{where}.reasoning_content must be a string or null, got {type(raw['reasoning_content']).__name__}"
        )
    return Message(
        role=raw["role"],
        content=_text(raw.get("content"), f"{where}.content", tool_result=raw["role"] == "tool"),
        reasoning=raw.get("reasoning_content"),
        tool_calls=tuple(_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)),
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
        messages=tuple(message_from_reference(m, i) for i, m in enumerate(messages)),
        thinking=thinking_mode == "thinking",
        reasoning_effort=reasoning_effort,
    )

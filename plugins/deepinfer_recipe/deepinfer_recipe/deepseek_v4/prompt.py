"""Render a conversation in the DeepSeek V4 prompt layout, as marker/text parts.

Layout (derived from the golden vectors in ``testdata/deepseek_v4_encoding``)::

    BOS [max-effort instruction "\\n\\n"] SYSTEM [\\n\\n## Tools ...] [\\n\\n## Response Format ...]
    <｜latest_reminder｜>TEXT                               (role latest_reminder)
    <｜User｜>TEXT [tools section]                          (user / developer)
    <｜Assistant｜><think>REASONING</think>CONTENT[\\n\\nDSML]<｜end▁of▁sentence｜>
    <｜User｜><tool_result>R1</tool_result>\\n\\n<tool_result>R2</tool_result>   (tool results,
                                                           in the order of the calls)
    <｜Assistant｜><think>   or   <｜Assistant｜></think>  (generation prompt)

Rules the vectors pin down:
* non-thinking mode: every assistant turn opens with ``</think>`` and no reasoning;
* thinking mode without tools: assistant turns before the last user turn are rendered as in
  non-thinking mode (their reasoning dropped); later ones keep ``<think>REASONING</think>``;
* with tools anywhere in the conversation nothing is dropped;
* a user turn with ``task`` (DeepSeek's quick instructions) makes the answer open with
  ``</think><｜task｜>``.

Choices the vectors do not pin down (documented guesses): a user message right after tool
results joins that turn after ``\\n\\n``; tools come before the response format in a system
text; request-level tools / response format attach to the first system message (an empty
one is created when there is none, as in vector ``thinking_two_parallel_calls...``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from deepinfer_core.codecs import Message

from . import templates
from .dsml import V4_TAGS, DsmlTags, render_tool_calls
from .tokens import (
    ASSISTANT,
    BOS,
    EOS,
    LATEST_REMINDER,
    TASK_NAMES,
    THINK_CLOSE,
    THINK_OPEN,
    USER,
    Marker,
    Part,
    split_trusted,
    task_marker,
)

USER_ROLES = ("user", "developer")


@dataclass(frozen=True)
class RenderOptions:
    thinking: bool = True
    effort: str = "high"  # low | high | max (already normalized)
    tags: DsmlTags = V4_TAGS


def attach_request_level(messages: Sequence[Message], tools: Sequence[dict], response_format: dict | None) -> tuple[Message, ...]:
    """Move request-level tools / response format onto the first system message, unless some
    message already carries its own (then the request-level copy would be a duplicate)."""
    msgs = list(messages)
    if response_format is not None and response_format.get("type") == "text":
        response_format = None  # plain text is the default; nothing to render
    need_tools = bool(tools) and not any(m.tools for m in msgs)
    need_format = response_format is not None and not any(m.response_format for m in msgs)
    if not (need_tools or need_format):
        return tuple(msgs)
    if not msgs or msgs[0].role != "system":
        msgs.insert(0, Message(role="system", content=""))
    first = msgs[0]
    msgs[0] = replace(
        first,
        tools=tuple(tools) if need_tools else first.tools,
        response_format=response_format if need_format else first.response_format,
    )
    return tuple(msgs)


def _text_with_sections(message: Message) -> list[Part]:
    parts: list[Part] = [message.content]
    if message.tools:
        parts += split_trusted("\n\n" + templates.TOOLS_HEADER)
        parts.append("\n".join(templates.tool_schema_line(t) for t in message.tools))
        parts += split_trusted(templates.TOOLS_FOOTER)
    if message.response_format:
        parts += split_trusted("\n\n" + templates.RESPONSE_FORMAT_HEADER)
        parts.append(templates.response_format_json(message.response_format))
    return parts


def _ordered_results(results: list[Message], previous: Message | None) -> list[Message]:
    """Tool results in the order of the calls that asked for them (vector
    ``thinking_two_parallel_calls_results_reordered``); unknown ids keep their place at the end."""
    if previous is None or not previous.tool_calls:
        return results
    order = {call.id: i for i, call in enumerate(previous.tool_calls) if call.id}
    return sorted(results, key=lambda m: order.get(m.tool_call_id or "", len(order)))


def _task_of(message: Message) -> str | None:
    task = message.extra.get("task") if message.extra else None
    if task is None:
        return None
    if task not in TASK_NAMES:
        raise ValueError(f"unknown DeepSeek task {task!r}; expected one of {', '.join(TASK_NAMES)}")
    return task


def _assistant_opening(thinking_kept: bool, reasoning: str | None, task: str | None) -> list[Part]:
    if task is not None:
        return [Marker(THINK_CLOSE), Marker(task_marker(task))]
    if thinking_kept:
        return [Marker(THINK_OPEN), reasoning or "", Marker(THINK_CLOSE)]
    return [Marker(THINK_CLOSE)]


def render_parts(messages: Sequence[Message], options: RenderOptions = RenderOptions()) -> list[Part]:
    """The whole prompt as parts; ``tokens.prompt_text(parts)`` is the reference string."""
    parts: list[Part] = [Marker(BOS)]
    if options.effort == "max":
        parts += split_trusted(templates.MAX_EFFORT_INSTRUCTION + "\n\n")
    tools_anywhere = any(m.tools for m in messages)
    drop_old_reasoning = options.thinking and not tools_anywhere
    last_user = max((i for i, m in enumerate(messages) if m.role in USER_ROLES), default=-1)
    previous_assistant: Message | None = None
    pending_task: str | None = None
    in_tool_turn = False  # the last thing rendered is an open tool-results user turn
    i = 0
    while i < len(messages):
        message = messages[i]
        role = message.role
        if role == "system":
            parts += _text_with_sections(message)
        elif role == "latest_reminder":
            parts += [Marker(LATEST_REMINDER), message.content]
        elif role in USER_ROLES:
            parts += ["\n\n"] if in_tool_turn else [Marker(USER)]
            parts += _text_with_sections(message)
            pending_task = _task_of(message)
        elif role == "tool":
            j = i
            while j < len(messages) and messages[j].role == "tool":
                j += 1
            results = _ordered_results(list(messages[i:j]), previous_assistant)
            parts.append(Marker(USER))
            parts.append("\n\n".join(f"<tool_result>{m.content}</tool_result>" for m in results))
            in_tool_turn = True
            i = j
            continue
        elif role == "assistant":
            kept = options.thinking and not (drop_old_reasoning and i < last_user)
            parts.append(Marker(ASSISTANT))
            parts += _assistant_opening(kept, message.reasoning, pending_task)
            parts.append(message.content)
            if message.tool_calls:
                parts.append("\n\n")
                parts += render_tool_calls(message.tool_calls, options.tags)
            parts.append(Marker(EOS))
            previous_assistant, pending_task = message, None
        else:
            raise ValueError(f"DeepSeek V4 prompts have no role {role!r}")
        in_tool_turn = False
        i += 1
    if not messages or messages[-1].role != "assistant":
        parts.append(Marker(ASSISTANT))
        parts += _assistant_opening(False, None, pending_task) if pending_task else (
            [Marker(THINK_OPEN)] if options.thinking else [Marker(THINK_CLOSE)]
        )
    return parts

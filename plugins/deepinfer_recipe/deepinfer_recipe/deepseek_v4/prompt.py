"""Render a conversation in the DeepSeek V4 prompt layout, as marker/text parts.

Equal to DeepSeek's reference encoder (``encoding/encoding_dsv4.py`` of the V4 release), checked
against its output in ``tests/data/deepseek_v4_encoding``. After :mod:`.turns` has merged,
ordered and trimmed the messages, each turn renders as::

    system            TEXT [\\n\\n## Tools ...] [\\n\\n## Response Format ...]
    user              <｜User｜>TEXT                 (merged blocks, see turns.py)
    developer         <｜User｜>TEXT [sections]
    latest_reminder   <｜latest_reminder｜>TEXT
    assistant         [REASONING</think>]CONTENT[\\n\\n<｜DSML｜tool_calls>...][<｜end▁of▁sentence｜>]

and the text between turns belongs to the turn before: a user/developer turn that is last or
followed by an assistant or latest_reminder turn ends with the generation prompt
``<｜Assistant｜><think>`` (thinking mode, unless history is dropped and a later user turn
follows) or ``<｜Assistant｜></think>``. So an assistant turn with no user turn before it has no
``<｜Assistant｜>``, and a trailing latest_reminder comes after the generation prompt. A turn
with a ``task`` ends with ``<｜TASK｜>`` instead (``action``: ``<｜Assistant｜><think|/think><｜action｜>``),
and the assistant turn after it renders no reasoning. Reasoning is rendered in thinking mode
only, for every assistant turn when tools are present and otherwise only after the last user
turn. The ``max`` effort instruction opens the prompt in thinking mode only. An assistant turn
with ``wo_eos`` (prefix continuation) ends without ``<｜end▁of▁sentence｜>``.

Where the reference raises we render instead: an empty developer turn renders empty; tool-call
arguments that are not a JSON object render like non-JSON text (see :mod:`.dsml`).
Request-level tools / response format (the codecs' form) attach to the first system message,
created empty when there is none.
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
    THINK_CLOSE,
    THINK_OPEN,
    USER,
    Marker,
    Part,
    split_trusted,
    task_marker,
)
from .turns import USER_ROLES, Turn, conversation_turns, last_user_index


@dataclass(frozen=True)
class RenderOptions:
    thinking: bool = True
    effort: str = "high"  # low | high | max (already normalized)
    tags: DsmlTags = V4_TAGS


def attach_request_level(
    messages: Sequence[Message], tools: Sequence[dict], response_format: dict | None
) -> tuple[Message, ...]:
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


def _body(turn: Turn, reasoning_shown: bool, tags: DsmlTags) -> list[Part]:
    message = turn.message
    if turn.role == "system":
        return _text_with_sections(message)
    if turn.role == "developer":
        return [Marker(USER), *_text_with_sections(message)]
    if turn.role == "user":  # the reference renders no sections in a user turn
        return [Marker(USER), message.content]
    if turn.role == "latest_reminder":
        return [Marker(LATEST_REMINDER), message.content]
    parts: list[Part] = [message.reasoning or "", Marker(THINK_CLOSE)] if reasoning_shown else []
    parts.append(message.content)
    if message.tool_calls:
        parts += render_tool_calls(message.tool_calls, tags)
    if not turn.without_eos:
        parts.append(Marker(EOS))
    return parts


def _after(turn: Turn, think: bool, thinking_mode: bool) -> list[Part]:
    """What follows a turn that is last or followed by an assistant / latest_reminder turn;
    ``think``: whether this generation prompt opens reasoning (not in dropped history)."""
    if turn.task == "action":
        return [Marker(ASSISTANT), Marker(THINK_OPEN if thinking_mode else THINK_CLOSE), Marker(task_marker("action"))]
    if turn.task is not None:
        return [Marker(task_marker(turn.task))]
    if turn.role in USER_ROLES:
        return [Marker(ASSISTANT), Marker(THINK_OPEN if think else THINK_CLOSE)]
    return []


def render_parts(messages: Sequence[Message], options: RenderOptions = RenderOptions()) -> list[Part]:
    """The whole prompt as parts; ``tokens.prompt_text(parts)`` is the reference string."""
    # tools on a user or tool message neither render nor keep history (the reference rebuilds
    # those messages without them)
    drop = options.thinking and not any(m.tools for m in messages if m.role not in ("user", "tool"))
    turns = conversation_turns(messages, drop_history=drop)
    last_user = last_user_index(turns)
    parts: list[Part] = [Marker(BOS)]
    if turns and options.thinking and options.effort == "max":
        parts += split_trusted(templates.MAX_EFFORT_INSTRUCTION + "\n\n")
    for i, turn in enumerate(turns):
        after_task = i > 0 and turns[i - 1].task is not None
        shown = options.thinking and not after_task and (not drop or i > last_user)
        parts += _body(turn, shown, options.tags)
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if following in (None, "assistant", "latest_reminder"):
            parts += _after(turn, options.thinking and (not drop or i >= last_user), options.thinking)
    return parts


def opens_thinking(parts: Sequence[Part]) -> bool:
    """Whether the model's output starts inside ``<think>`` (the prompt ends with it)."""
    return bool(parts) and parts[-1] == Marker(THINK_OPEN)

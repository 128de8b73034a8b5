"""Conversation -> the turns DeepSeek's V4 reference encoder renders (before any layout).

The reference has no ``tool`` role and renders a user turn per run of user input, so three steps
run before rendering, in the reference's order (each pinned by ``reference_behaviour.json``):

1. **merge** - tool results and user messages that follow a user turn join it; the turn's
   blocks are joined by ``\\n\\n`` (text as written, results wrapped in ``<tool_result>``). A
   tool result after anything else opens a new user turn. A user turn carrying a ``task``
   takes no further user messages (tool results still join); a ``task`` on a user message that
   joins an earlier turn is lost, as in the reference.
2. **order** - in a turn with two or more results, the results are put in the order of the
   calls of the latest assistant message that made calls. A result whose id matches no call
   sorts as if it answered the first call (the sort is stable); text blocks keep their slots.
3. **history** - in thinking mode with no tools anywhere, assistant turns before the last
   user/developer turn lose their reasoning and developer turns there are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from deepinfer_core.codecs import Message

from .tokens import TASK_NAMES

USER_ROLES = ("user", "developer")
ROLES = ("system", "user", "developer", "assistant", "tool", "latest_reminder")


@dataclass(frozen=True)
class Block:
    """One piece of a user turn: text, or a tool result (``call_id`` set)."""

    text: str
    call_id: str | None = None

    @property
    def rendered(self) -> str:
        return self.text if self.call_id is None else f"<tool_result>{self.text}</tool_result>"


@dataclass(frozen=True)
class Turn:
    """A message as rendered: user turns carry their merged text in ``message.content``."""

    message: Message
    task: str | None = None

    @property
    def role(self) -> str:
        return self.message.role

    @property
    def without_eos(self) -> bool:
        """Prefix continuation: the assistant turn is left open for the model to continue."""
        return bool(self.message.extra.get("wo_eos"))


def task_of(message: Message) -> str | None:
    task = message.extra.get("task") if message.extra else None
    if task is not None and task not in TASK_NAMES:
        raise ValueError(f"unknown DeepSeek task {task!r}; expected one of {', '.join(TASK_NAMES)}")
    return task


def _merge(messages: Sequence[Message]) -> list[tuple[Message, list[Block] | None, str | None]]:
    """Step 1: (message, blocks of a user turn or None, task)."""
    merged: list[tuple[Message, list[Block] | None, str | None]] = []
    for message in messages:
        if message.role not in ROLES:
            raise ValueError(f"DeepSeek V4 prompts have no role {message.role!r}; expected one of {', '.join(ROLES)}")
        task = task_of(message)
        open_user = merged and merged[-1][1] is not None
        if message.role == "tool":
            block = Block(message.content, message.tool_call_id or "")
            if open_user:
                merged[-1][1].append(block)
            else:
                merged.append((Message(role="user"), [block], None))
        elif message.role == "user":
            if open_user and merged[-1][2] is None:
                merged[-1][1].append(Block(message.content))
            else:
                merged.append((message, [Block(message.content)], task))
        else:
            merged.append((message, None, task))
    return merged


def _order_results(blocks: list[Block], call_order: dict[str, int]) -> list[Block]:
    """Step 2 for one turn."""
    results = [b for b in blocks if b.call_id is not None]
    if len(results) < 2 or not call_order:
        return blocks
    queue = iter(sorted(results, key=lambda b: call_order.get(b.call_id or "", 0)))
    return [next(queue) if b.call_id is not None else b for b in blocks]


def _drop_history(turns: list[Turn]) -> list[Turn]:
    """Step 3."""
    last_user = last_user_index(turns)
    kept: list[Turn] = []
    for i, turn in enumerate(turns):
        if i >= last_user or turn.role in ("user", "system", "latest_reminder"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, message=replace(turn.message, reasoning=None)))
    return kept


def last_user_index(turns: Sequence[Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in USER_ROLES), default=-1)


def conversation_turns(messages: Sequence[Message], *, drop_history: bool) -> list[Turn]:
    """Steps 1-3; ``drop_history`` is "thinking mode and no tools anywhere"."""
    turns: list[Turn] = []
    call_order: dict[str, int] = {}
    for message, blocks, task in _merge(messages):
        if message.role == "assistant" and message.tool_calls:
            call_order = {call.id: k for k, call in enumerate(message.tool_calls) if call.id}
        if blocks is not None:
            text = "\n\n".join(b.rendered for b in _order_results(blocks, call_order))
            message = replace(message, content=text)
        turns.append(Turn(message, task))
    return _drop_history(turns) if drop_history else turns

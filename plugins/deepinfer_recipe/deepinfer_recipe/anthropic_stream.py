"""Anthropic Messages streaming: turning parser deltas into the content-block event sequence.

Anthropic streams each content block separately::

    message_start
    content_block_start(0, thinking) content_block_delta(thinking_delta)* signature_delta content_block_stop
    content_block_start(1, text)     content_block_delta(text_delta)*                    content_block_stop
    content_block_start(2, tool_use) content_block_delta(input_json_delta)               content_block_stop
    message_delta(stop_reason, usage) message_stop

so the stream keeps one open block and closes it whenever the kind of delta changes.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable, Iterator

from deepinfer_core.codecs import ConversationRequest, ParsedOutput, ToolCall

from . import validation as v
from .common import anthropic_stop_reason, sse_event


class MessageStream:
    def __init__(
        self, request: ConversationRequest, usage: Callable[[dict], dict], tool_use: Callable[[ToolCall], dict]
    ):
        self.request = request
        self._usage = usage
        self._tool_use = tool_use
        self._index = -1
        self._open: str | None = None  # kind of the open block: thinking | text | tool_use
        self._streamed: set[str] = set()  # ids of tool calls streamed piece by piece
        self._tool_id = ""  # the streamed tool call whose block is open

    def _start(self, block: dict) -> str:
        self._index += 1
        self._open = block["type"]
        return sse_event(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> Iterator[str]:
        if self._open is None:
            return
        if self._open == "thinking":  # our reasoning is not signed; the field is still sent
            yield self._delta({"type": "signature_delta", "signature": ""})
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        self._open = None

    def _switch(self, kind: str) -> Iterator[str]:
        if self._open != kind:
            yield from self._close()
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            yield self._start(block)

    def frames(self, events: Iterable[ParsedOutput]) -> Iterator[str]:
        iterator = iter(events)
        first = next(iterator, None)
        usage = (first.usage if first is not None else None) or {}
        start_usage = {**self._usage(usage), "output_tokens": 0}
        message = {
            "id": self.request.extra.get("request_id") or v.new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": start_usage,
        }
        yield sse_event("message_start", {"type": "message_start", "message": message})
        finish_reason, calls, stop_sequence = "stop", 0, None
        for event in _chain(first, iterator):
            if event.reasoning:
                yield from self._switch("thinking")
                yield self._delta({"type": "thinking_delta", "thinking": event.reasoning})
            earlier = set(self._streamed)  # a tool_use block already open ends before this event's content
            calls += yield from self._pieces(event, earlier)
            if event.content:
                yield from self._switch("text")
                yield self._delta({"type": "text_delta", "text": event.content})
            calls += yield from self._pieces(event, None, skip=earlier)
            for call in event.tool_calls:
                if call.id in self._streamed:  # streamed piece by piece (closed above)
                    continue
                yield from self._close()
                block = self._tool_use(call)
                arguments = block["input"]
                yield self._start({**block, "input": {}})
                yield self._delta(
                    {"type": "input_json_delta", "partial_json": json.dumps(arguments, ensure_ascii=False)}
                )
                yield from self._close_tool()
                calls += 1
            finish_reason = event.finish_reason or finish_reason
            stop_sequence = event.stop_sequence or stop_sequence
            usage = event.usage if event.usage is not None else usage
        yield from self._close()
        delta = {
            "stop_reason": anthropic_stop_reason(finish_reason, calls > 0),
            "stop_sequence": stop_sequence if finish_reason == "stop_sequence" else None,
        }
        yield sse_event(
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": self._usage(usage)["output_tokens"]}},
        )
        yield sse_event("message_stop", {"type": "message_stop"})

    def _pieces(self, event: ParsedOutput, only: set[str] | None, skip: set[str] = frozenset()):
        """Tool calls streamed piece by piece (``input_json_delta``), those of ``only`` ids or
        all but ``skip``; a complete one closes its block. Returns how many calls it began."""
        began = 0
        chosen = (lambda i: i in only) if only is not None else (lambda i: i not in skip)
        for piece in event.tool_call_deltas:
            if not chosen(piece.id):
                continue
            if piece.id not in self._streamed:
                self._streamed.add(piece.id)
                began += 1
                yield from self._close()
                yield self._start({"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
                self._tool_id = piece.id
            if piece.arguments and self._open == "tool_use" and self._tool_id == piece.id:
                yield self._delta({"type": "input_json_delta", "partial_json": piece.arguments})
        for call in event.tool_calls:
            if chosen(call.id) and call.id in self._streamed and self._open == "tool_use" and self._tool_id == call.id:
                yield from self._close()
        return began

    def _close_tool(self) -> Iterator[str]:
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        self._open = None


def _chain(first: ParsedOutput | None, rest: Iterator[ParsedOutput]) -> Iterator[ParsedOutput]:
    if first is not None:
        yield first
        yield from rest

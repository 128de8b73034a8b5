"""Responses API output items and their streaming event sequence.

Each output item (reasoning, message, function call) streams as::

    response.output_item.added
      response.content_part.added  response.{reasoning_text|output_text}.delta*  ...done  content_part.done
      (function calls: response.function_call_arguments.delta / .done instead)
    response.output_item.done

framed by ``response.created`` / ``response.in_progress`` and ``response.completed`` (or
``response.incomplete``), every event numbered by ``sequence_number``. One item is open at a
time; a change of delta kind closes it, as the model's output is reasoning, then text, then calls.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from deepinfer_core.codecs import ConversationRequest, ParsedOutput, ToolCall, ToolCallDelta

from . import validation as v
from .common import sse_event

# The codec's ``response(request, output, usage, finish_reason, response_id)``: the response object
# (``finish_reason`` None while in progress), passed in so this module need not import the codec.
ResponseObject = Callable[[ConversationRequest, list[dict], dict, "str | None", str], dict]


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict:
    call_id = call.id or "call_" + item_id.removeprefix("fc_")
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def output_items(result: ParsedOutput) -> list[dict]:
    """The output of a finished (non-streamed) response."""
    items = []
    if result.reasoning:
        items.append(reasoning_item(v.new_id("rs_"), result.reasoning, "completed"))
    if result.content:
        items.append(message_item(v.new_id("msg_"), result.content, "completed"))
    items += [call_item(v.new_id("fc_"), call, call.arguments, "completed") for call in result.tool_calls]
    return items


class ResponseEventStream:
    def __init__(self, response: ResponseObject, request: ConversationRequest) -> None:
        self.response = response
        self.request = request
        self.response_id = request.extra.get("request_id") or v.new_id("resp_")
        self.output: list[dict] = []  # finished items
        self._seq = 0
        self._open: str | None = None  # "reasoning" | "message" | "call" (streamed piece by piece)
        self._streaming: ToolCall | None = None  # the call being streamed (its arguments in _text)
        self._streamed: set[str] = set()  # ids of the calls streamed piece by piece
        self._item_id = ""
        self._text = ""

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(kind, payload)

    def _where(self) -> dict:
        return {"item_id": self._item_id, "output_index": len(self.output)}

    def _start(self, kind: str) -> Iterator[str]:
        if self._open == kind:
            return
        yield from self._close()
        self._open, self._text = kind, ""
        if kind == "reasoning":
            self._item_id = v.new_id("rs_")
            item, part = reasoning_item(self._item_id, None, "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            self._item_id = v.new_id("msg_")
            item, part = (
                message_item(self._item_id, None, "in_progress"),
                {"type": "output_text", "text": "", "annotations": []},
            )
        yield self._event("response.output_item.added", output_index=len(self.output), item=item)
        yield self._event("response.content_part.added", **self._where(), content_index=0, part=part)

    def _delta(self, text: str) -> str:
        self._text += text
        if self._open == "reasoning":
            return self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        return self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])

    def _close(self) -> Iterator[str]:
        if self._open is None:
            return
        if self._open == "call":
            yield from self._end_call(ToolCall(self._streaming.name, self._text, self._streaming.id))
            return
        if self._open == "reasoning":
            item = reasoning_item(self._item_id, self._text, "completed")
            yield self._event("response.reasoning_text.done", **self._where(), content_index=0, text=self._text)
        else:
            item = message_item(self._item_id, self._text, "completed")
            yield self._event(
                "response.output_text.done", **self._where(), content_index=0, text=self._text, logprobs=[]
            )
        yield self._event("response.content_part.done", **self._where(), content_index=0, part=item["content"][0])
        yield self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self._open = None

    def _call(self, call: ToolCall) -> Iterator[str]:
        yield from self._close()
        self._item_id = v.new_id("fc_")
        where = self._where()
        yield self._event(
            "response.output_item.added",
            output_index=where["output_index"],
            item=call_item(self._item_id, call, "", "in_progress"),
        )
        yield self._event("response.function_call_arguments.delta", **where, delta=call.arguments)
        yield self._event("response.function_call_arguments.done", **where, arguments=call.arguments, name=call.name)
        item = call_item(self._item_id, call, call.arguments, "completed")
        yield self._event("response.output_item.done", output_index=where["output_index"], item=item)
        self.output.append(item)

    def _calls(self, event: ParsedOutput, only: set[str] | None, skip: frozenset | set = frozenset()) -> Iterator[str]:
        """The event's call pieces and calls (those of ``only`` ids, or all but ``skip``)."""
        for piece in event.tool_call_deltas:
            if (piece.id in only) if only is not None else piece.id not in skip:
                self._streamed.add(piece.id)
                yield from self._call_piece(piece)
        for call in event.tool_calls:
            if (call.id in only) if only is not None else call.id not in skip:
                if self._open == "call" and self._streaming.id == call.id:
                    yield from self._end_call(call)
                elif call.id not in self._streamed:  # streamed ones closed early are not repeated
                    yield from self._call(call)

    def _call_piece(self, piece: ToolCallDelta) -> Iterator[str]:
        """A call streamed piece by piece: its item opens on the first delta, each arguments
        piece is a ``function_call_arguments.delta``, and the complete call closes it."""
        if self._open != "call" or self._streaming.id != piece.id:
            yield from self._close()
            self._open, self._text, self._item_id = "call", "", v.new_id("fc_")
            self._streaming = ToolCall(piece.name, "", piece.id)
            yield self._event(
                "response.output_item.added",
                output_index=len(self.output),
                item=call_item(self._item_id, self._streaming, "", "in_progress"),
            )
        if piece.arguments:
            self._text += piece.arguments
            yield self._event("response.function_call_arguments.delta", **self._where(), delta=piece.arguments)

    def _end_call(self, call: ToolCall) -> Iterator[str]:
        where = self._where()
        yield self._event("response.function_call_arguments.done", **where, arguments=call.arguments, name=call.name)
        item = call_item(self._item_id, call, call.arguments, "completed")
        yield self._event("response.output_item.done", output_index=where["output_index"], item=item)
        self.output.append(item)
        self._open, self._streaming = None, None

    def frames(self, events: Iterable[ParsedOutput]) -> Iterator[str]:
        start = self.response(self.request, [], {}, None, self.response_id)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        finish_reason, usage = "stop", {}
        for event in events:
            if event.reasoning:
                yield from self._start("reasoning")
                yield self._delta(event.reasoning)
            earlier = set(self._streamed)  # a call already open ends before this event's content
            yield from self._calls(event, earlier)
            if event.content:
                yield from self._start("message")
                yield self._delta(event.content)
            yield from self._calls(event, None, skip=earlier)
            finish_reason = event.finish_reason or finish_reason
            usage = event.usage if event.usage is not None else usage
        yield from self._close()
        final = self.response(self.request, self.output, usage, finish_reason, self.response_id)
        yield self._event(
            "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
        )

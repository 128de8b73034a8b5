"""Engine snapshots -> parsed protocol events, for one request (streamed or not).

A codec's ``stream(request, events)`` is a plain generator that pulls events as it goes, so
a streamed request runs it in its own thread, fed from the request's blocking output queue; the
frames go back to the event loop through ``call_soon_threadsafe``. Neither the event loop nor
the step thread ever waits on a codec.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from typing import Callable, Iterator

from ..codecs import OutputParser, ParsedOutput, ProtocolError
from ..engine.outputs import RequestOutput
from ..engine.sampler import ALL_MASKED_MESSAGE
from .front import RequestSink

log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """The engine failed this request (or the whole step): a 500 in the protocol's shape, or a
    400 when the request itself asked for the impossible (``status``)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


def usage_of(out: RequestOutput) -> dict:
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.outputs[0].token_ids),
        "cached_tokens": out.num_cached_tokens,
    }


def finish_reason_of(out: RequestOutput) -> str:
    """The engine's reason in the codecs' neutral vocabulary (see the recipe's ``common``)."""
    completion = out.outputs[0]
    if completion.finish_reason == "error":
        error = getattr(completion, "error", None) or "internal error"
        if error == ALL_MASKED_MESSAGE:  # its constraints and min_tokens conflict: the client's error
            raise RequestFailed(f"the request cannot be completed: {error}", status=400)
        raise RequestFailed(f"the engine failed this request: {error}")
    if completion.finish_reason == "length":
        return "length"
    if isinstance(completion.stop_reason, str):
        return "stop_sequence"
    return "stop"


def merge(a: ParsedOutput, b: ParsedOutput) -> ParsedOutput:
    return ParsedOutput(
        content=a.content + b.content,
        reasoning=a.reasoning + b.reasoning,
        tool_calls=a.tool_calls + b.tool_calls,
        finish_reason=b.finish_reason or a.finish_reason,
        usage=b.usage if b.usage is not None else a.usage,
        stop_sequence=b.stop_sequence or a.stop_sequence,
        tool_call_deltas=a.tool_call_deltas + b.tool_call_deltas,
    )


def final_result(out: RequestOutput, parser: OutputParser) -> tuple[ParsedOutput, str]:
    """A finished request's whole output, parsed; (result, neutral finish reason)."""
    reason = finish_reason_of(out)
    parsed = merge(parser.push(out.outputs[0].text), parser.finish())
    if parsed.finish_reason is None and reason == "stop_sequence":  # the engine matched a stop string
        parsed = replace(parsed, stop_sequence=out.outputs[0].stop_reason)
    return parsed, parsed.finish_reason or reason


def events(sink: RequestSink, parser: OutputParser, on_parser_stop: Callable[[], None]) -> Iterator[ParsedOutput]:
    """Blocking: parsed deltas of one request; the first carries the prompt usage (Anthropic's
    ``message_start`` shows it), the last the finish reason and full usage."""
    first = True
    while True:
        out = sink.outputs.get()
        if out is None:  # aborted, or the step failed
            if sink.error is not None:
                raise RequestFailed(f"the engine failed: {sink.error}")
            return
        completion = out.outputs[0]
        parsed = parser.push(completion.delta_text) if completion.delta_text else ParsedOutput()
        if parsed.finish_reason is not None:  # the parser saw a stop sequence in the answer
            on_parser_stop()
            yield replace(parsed, usage=usage_of(out))
            return
        if out.finished:
            reason = finish_reason_of(out)
            hit = completion.stop_reason if reason == "stop_sequence" else None
            yield replace(merge(parsed, parser.finish()), finish_reason=reason, usage=usage_of(out), stop_sequence=hit)
            return
        if first:
            parsed, first = replace(parsed, usage=usage_of(out)), False
            yield parsed
        elif parsed.content or parsed.reasoning or parsed.tool_calls or parsed.tool_call_deltas:
            yield parsed


def start_collect_thread(
    sink: RequestSink, parser: OutputParser, on_parser_stop: Callable[[], None], loop: asyncio.AbstractEventLoop
) -> asyncio.Future:
    """A non-streamed request parsed while it runs (its stop sequences are found by the parser,
    see ``PreparedRequest.parser_stops``), so it ends at the stop instead of at ``max_tokens``.
    Resolves to (whole result, neutral finish reason, usage); an abort or failure is a
    :class:`RequestFailed`. A thread of its own: it blocks on the request's output queue."""
    done: asyncio.Future = loop.create_future()

    def settle(value, error) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(value)

    def collect() -> None:
        try:
            result = ParsedOutput()
            for event in events(sink, parser, on_parser_stop):
                result = merge(result, event)
            if result.finish_reason is None:
                raise RequestFailed("the request was aborted")
            value, error = (result, result.finish_reason, result.usage or {}), None
        except Exception as exc:
            value, error = (
                None,
                exc if isinstance(exc, RequestFailed) else RequestFailed(f"parsing the output failed: {exc}"),
            )
        loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=collect, name="deepinfer-collect", daemon=True).start()
    return done


def start_frames_thread(
    codec,
    request,
    sink: RequestSink,
    parser: OutputParser,
    on_parser_stop: Callable[[], None],
    loop: asyncio.AbstractEventLoop,
) -> asyncio.Queue:
    """Run ``codec.stream`` in a thread; its frames (then None) arrive on the returned queue."""
    frames: asyncio.Queue = asyncio.Queue()

    def put(frame: str | None) -> None:
        loop.call_soon_threadsafe(frames.put_nowait, frame)

    def produce() -> None:
        try:
            for frame in codec.stream(request, events(sink, parser, on_parser_stop)):
                put(frame)
        except Exception as exc:
            if not isinstance(exc, RequestFailed):
                log.exception("streaming a response failed")
            status = exc.status if isinstance(exc, RequestFailed) else 500
            error = ProtocolError(
                str(exc), status=status, code="server_error" if status >= 500 else "invalid_request_error"
            )
            error_frame = getattr(codec, "error_frame", None)
            if error_frame is not None:
                put(error_frame(error))
        finally:
            put(None)

    threading.Thread(target=produce, name="deepinfer-frames", daemon=True).start()
    return frames

"""One protocol route as an ASGI application: one HTTP exchange, from body to last byte.

Every exchange does the same things: read JSON, let the codec parse it, prepare token ids and
sampling parameters, submit to the engine front, and answer through the codec (a JSON body, or
SSE frames). Every refusal is a :class:`ProtocolError` rendered by that codec, so a client always
gets its own API's error shape: bad JSON or fields 400, unknown model 404, full queue 429 (with
``Retry-After``), draining 503.

The route is a plain ASGI callable rather than a Starlette endpoint so that the whole exchange,
including the sending of a streamed body, runs inside one ``try``: the front's lease is taken in
one place and released in one ``finally``, however the exchange ends (finished, refused, client
gone before or during the stream, an exception anywhere). A client that hangs up is noticed at
once: streams through Starlette's disconnect listener, non-streamed requests by waiting for
``http.disconnect`` next to the result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

from ..codecs import ProtocolError
from .front import Closed, QueueFull, RequestSink, Submission
from .results import RequestFailed, final_result, start_collect_thread, start_frames_thread, usage_of

log = logging.getLogger(__name__)


class ProtocolRoute:
    """The ASGI app behind one codec's routes on one server (``server.app`` mounts it)."""

    def __init__(self, server, codec) -> None:
        self.server = server
        self.codec = codec

    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import Request

        response = await self._exchange(Request(scope, receive), scope, receive, send)
        if response is not None:
            await response(scope, receive, send)

    def _error(self, error: ProtocolError):
        from starlette.responses import JSONResponse

        status, body = self.codec.render_error(error)
        headers = {"Retry-After": str(self.server.config.retry_after_s)} if status == 429 else None
        return JSONResponse(body, status_code=status, headers=headers)

    async def _parse(self, request):
        timeout = self.server.config.body_timeout_s
        try:  # a client that sends its body slowly (or never) does not hold a connection forever
            raw = await asyncio.wait_for(request.body(), timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(
                f"the request body did not arrive within {timeout:g} s", status=408, code="request_timeout"
            ) from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
        try:
            conversation = self.codec.parse_request(body)
        except ProtocolError:
            raise
        except Exception as exc:  # a codec that trips over a body must still answer 400
            log.warning("%s could not parse a request body: %r", self.codec.name, exc)
            raise ProtocolError(f"invalid request: {type(exc).__name__}: {exc}") from None
        name = self.server.config.model_name
        if conversation.model != name:
            raise ProtocolError(
                f"model {conversation.model!r} does not exist here; this server serves {name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        return conversation

    async def _exchange(self, request, scope, receive, send):
        """Returns a response to send, or None when it sent one itself (admitted requests)."""
        from starlette.requests import ClientDisconnect

        server, loop = self.server, asyncio.get_running_loop()
        try:
            conversation = await self._parse(request)
            prepared = await asyncio.to_thread(server.preparer.prepare, conversation)  # grammar compiles off the loop
            request_id = secrets.token_hex(8)
            read_as_it_goes = conversation.stream or prepared.parser_stops  # parser stops: read as it goes
            sink = RequestSink(loop, read_as_it_goes)
            submission = Submission(
                request_id, prepared.prompt_token_ids, prepared.params, final_only=not read_as_it_goes
            )
            lease = server.front.submit(submission, sink)
        except QueueFull as exc:
            server.metrics.rejected.inc()
            return self._error(
                ProtocolError(f"the server is at capacity ({exc}); retry later", status=429, code="rate_limit_exceeded")
            )
        except Closed as exc:
            return self._error(ProtocolError(str(exc), status=503, code="service_unavailable"))
        except ProtocolError as error:
            return self._error(error)
        except ClientDisconnect:  # hung up before its body arrived: nobody to answer, not our error
            log.info("%s: the client disconnected before sending its whole request body", self.codec.name)
            return None
        except Exception as exc:  # a bug, not the client's: still the protocol's own error shape
            log.exception("%s: preparing a request failed", self.codec.name)
            return self._error(
                ProtocolError(f"internal error: {type(exc).__name__}: {exc}", status=500, code="server_error")
            )
        try:  # from here the request holds a slot: the finally below is the one place it ends
            refused = await sink.admitted
            if refused is not None:
                status = 400 if isinstance(refused, (ValueError, TypeError)) else 500
                response = self._error(
                    ProtocolError(
                        str(refused), status=status, code="invalid_request_error" if status == 400 else "server_error"
                    )
                )
            elif conversation.stream:
                response = self._stream(conversation, prepared, request_id, sink, loop)
            else:
                response = await self._complete(conversation, prepared, request_id, sink, receive)
            await response(scope, receive, send)
        finally:
            lease.release()  # aborts the engine request unless it finished
        return None

    def _stream(self, conversation, prepared, request_id: str, sink: RequestSink, loop):
        from starlette.responses import StreamingResponse

        front = self.server.front
        frames = start_frames_thread(
            self.codec, conversation, sink, prepared.new_parser(), lambda: front.stop_early(request_id), loop
        )

        async def body():
            while (frame := await frames.get()) is not None:
                yield frame

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _complete(self, conversation, prepared, request_id: str, sink: RequestSink, receive):
        from starlette.responses import JSONResponse

        parsed = None
        if prepared.parser_stops:  # parsed as it runs, so that the parser's stop ends it early
            front = self.server.front
            parsed = start_collect_thread(
                sink, prepared.new_parser(), lambda: front.stop_early(request_id), asyncio.get_running_loop()
            )
        waited = parsed if parsed is not None else sink.final
        hung_up = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({waited, hung_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hung_up.cancel()
        if not waited.done():  # the lease's release aborts the request
            return self._error(ProtocolError("the client disconnected", status=499))
        if parsed is not None:
            try:
                result, reason, usage = parsed.result()
            except RequestFailed as exc:
                return self._error(
                    ProtocolError(
                        str(exc),
                        status=exc.status,
                        code="server_error" if exc.status >= 500 else "invalid_request_error",
                    )
                )
            return JSONResponse(self.codec.render(conversation, result, usage, reason))
        out = sink.final.result()
        try:
            if out is None:
                raise RequestFailed(
                    f"the engine failed: {sink.error}" if sink.error is not None else "the request was aborted"
                )
            result, reason = final_result(out, prepared.new_parser())
        except RequestFailed as exc:
            return self._error(
                ProtocolError(
                    str(exc), status=exc.status, code="server_error" if exc.status >= 500 else "invalid_request_error"
                )
            )
        return JSONResponse(self.codec.render(conversation, result, usage_of(out), reason))


async def _disconnected(receive) -> None:
    """Returns when the client hangs up (the body is already read, so ``receive`` has nothing
    else to say; it is the same wait Starlette's streaming response runs)."""
    while (await receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.5)  # a server that does not wait in receive must not spin the loop

"""The ASGI application: one route per codec route, plus models, health and metrics.

Every protocol route does the same five things: read JSON, let the codec parse it, prepare
token ids and sampling parameters, submit to the engine front, and answer through the codec
(a JSON body, or SSE frames). Every refusal is a :class:`ProtocolError` rendered by that
codec, so a client always gets its own API's error shape: bad JSON or fields 400, unknown model
404, full queue 429 (with ``Retry-After``), draining 503.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass

from ..codecs import ProtocolError
from .completions import CompletionsCodec
from .conversation import ConversationPreparer
from .front import Closed, EngineFront, QueueFull, RequestSink, Submission
from .metrics import ServerMetrics
from .results import RequestFailed, final_result, start_frames_thread, usage_of

log = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5


class NoProtocolCodecs(RuntimeError):
    """No installed plugin registers a protocol codec (``pip install deepinfer-recipe``)."""


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_queue: int = 64  # requests waiting beyond the running batch before 429
    retry_after_s: int = 1


class Server:
    """The server's state: engine front, metrics, codecs. ``app`` is the ASGI application."""

    def __init__(self, engine, host, config: ServerConfig) -> None:
        codecs = {name: factory() for name, factory in host.protocols().items()}
        if not codecs:
            raise NoProtocolCodecs("deepinfer serve: no protocol codecs are installed; install the deepinfer-recipe package (pip install deepinfer-recipe)")
        codecs.setdefault(CompletionsCodec.name, CompletionsCodec())
        self.codecs = codecs
        self.config = config
        self.engine = engine
        self.metrics = ServerMetrics(config.model_name)
        self.front = EngineFront(engine, max_queue=config.max_queue, on_output=self.metrics.on_output, on_step=self.metrics.on_step)
        self.preparer = ConversationPreparer(engine, host)
        self.app = self._build_app()

    def _build_app(self):
        from fastapi import FastAPI

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.front.start()
            try:
                yield
            finally:
                self.front.shutdown()

        app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        for codec in self.codecs.values():
            for method, path in codec.routes:
                app.add_route(path, self._handler(codec), methods=[method])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.render_metrics, methods=["GET"])
        return app

    # -- plain routes -------------------------------------------------------------------------
    async def models(self):
        """OpenAI's model list, with the fields Anthropic's SDK reads as well."""
        now = int(time.time())
        entry = {
            "id": self.config.model_name, "object": "model", "created": now, "owned_by": "deepinfer",
            "type": "model", "display_name": self.config.model_name,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "max_model_len": self.engine.max_model_len,
        }  # fmt: skip
        name = self.config.model_name
        return {"object": "list", "data": [entry], "has_more": False, "first_id": name, "last_id": name}

    async def health(self):
        from fastapi.responses import JSONResponse

        return JSONResponse({"status": "ok", "in_flight": self.front.in_flight, **self.front.stats})

    async def render_metrics(self):
        from fastapi.responses import Response

        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    # -- protocol routes ----------------------------------------------------------------------
    def _handler(self, codec):
        async def handle(request):  # a Starlette endpoint: the raw request, no model binding
            return await self._serve(codec, request)

        return handle

    def _error(self, codec, error: ProtocolError):
        from fastapi.responses import JSONResponse

        status, body = codec.render_error(error)
        headers = {"Retry-After": str(self.config.retry_after_s)} if status == 429 else None
        return JSONResponse(body, status_code=status, headers=headers)

    async def _parse(self, codec, request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
        try:
            conversation = codec.parse_request(body)
        except ProtocolError:
            raise
        except Exception as exc:  # a codec that trips over a body must still answer 400
            log.warning("%s could not parse a request body: %r", codec.name, exc)
            raise ProtocolError(f"invalid request: {type(exc).__name__}: {exc}") from None
        if conversation.model != self.config.model_name:
            raise ProtocolError(f"model {conversation.model!r} does not exist here; this server serves {self.config.model_name!r}",
                                status=404, param="model", code="model_not_found")
        return conversation

    async def _serve(self, codec, request):
        loop = asyncio.get_running_loop()
        try:
            conversation = await self._parse(codec, request)
            prepared = await asyncio.to_thread(self.preparer.prepare, conversation)  # grammar compiles off the loop
            request_id = secrets.token_hex(8)
            sink = RequestSink(loop, conversation.stream)
            try:
                self.front.submit(Submission(request_id, prepared.prompt_token_ids, prepared.params), sink)
            except QueueFull as exc:
                self.metrics.rejected.inc()
                raise ProtocolError(f"the server is at capacity ({exc}); retry later", status=429, code="rate_limit_exceeded") from None
            except Closed as exc:
                raise ProtocolError(str(exc), status=503, code="service_unavailable") from None
            refused = await sink.admitted
            if refused is not None:
                raise ProtocolError(str(refused)) from None
        except ProtocolError as error:
            return self._error(codec, error)
        if conversation.stream:
            return self._stream(codec, conversation, prepared, request_id, sink, loop)
        return await self._complete(codec, conversation, prepared, request_id, sink, request)

    def _stream(self, codec, conversation, prepared, request_id: str, sink: RequestSink, loop):
        from fastapi.responses import StreamingResponse

        frames = start_frames_thread(codec, conversation, sink, prepared.new_parser(), lambda: self.front.abort(request_id), loop)

        async def body():
            finished = False
            try:
                while (frame := await frames.get()) is not None:
                    yield frame
                finished = True
            finally:
                if not finished:  # the client went away: free its blocks now
                    self.front.abort(request_id)

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _complete(self, codec, conversation, prepared, request_id: str, sink: RequestSink, request):
        while True:
            done, _ = await asyncio.wait({sink.final}, timeout=_DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                self.front.abort(request_id)
                return self._error(codec, ProtocolError("the client disconnected", status=499))
        out = sink.final.result()
        try:
            if out is None:
                raise RequestFailed(f"the engine failed: {sink.error}" if sink.error is not None else "the request was aborted")
            result, reason = final_result(out, prepared.new_parser())
        except RequestFailed as exc:
            return self._error(codec, ProtocolError(str(exc), status=500, code="server_error"))
        from fastapi.responses import JSONResponse

        return JSONResponse(codec.render(conversation, result, usage_of(out), reason))

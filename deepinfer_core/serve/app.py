"""The ASGI application: one route per codec route, plus models, health and metrics.

Each protocol route is a :class:`~.exchange.ProtocolRoute` (parse, prepare, submit, answer in
the codec's shape); this module holds the server's state and the plain routes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass

from starlette.requests import Request

from ..codecs import ProtocolError
from . import inspect as inspect_module
from .completions import CompletionsCodec
from .conversation import ConversationPreparer
from .exchange import ProtocolRoute
from .front import EngineFront
from .inspect import InspectBody, PromptInspector
from .metrics import ServerMetrics
from .sampling_defaults import SamplingDefaults, model_sampling_defaults
from .web import add_web_routes, build_openapi

log = logging.getLogger(__name__)
# deepinfer-recipe is not on PyPI: it installs from the repository
RECIPE_INSTALL_HINT = (
    "install the deepinfer-recipe plugin from the deepinfer repository: pip install -e plugins/deepinfer_recipe "
    "in a checkout, or pip install 'deepinfer-recipe @ git+<repository URL>#subdirectory=plugins/deepinfer_recipe'"
)


class NoProtocolCodecs(RuntimeError):
    """No installed plugin registers a protocol codec (:data:`RECIPE_INSTALL_HINT` says what to do)."""


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_queue: int = 64  # requests waiting beyond the running batch before 429
    retry_after_s: int = 1
    sampling_defaults: str = "model"  # "model": the model's recommended sampling; "protocol": each API's
    body_timeout_s: float = 30.0  # a request body not complete by then: 408 (slow or stalled clients)


class Server:
    """The server's state: engine front, metrics, codecs. ``app`` is the ASGI application."""

    def __init__(self, engine, host, config: ServerConfig, front=None) -> None:
        """``front``: what requests are submitted to (default: an :class:`EngineFront` around
        ``engine``); ``deepinfer cluster``'s ingress passes one that forwards to its replicas."""
        codecs = {name: factory() for name, factory in host.protocols().items()}
        if not codecs:
            raise NoProtocolCodecs(f"deepinfer serve: no protocol codecs are installed; {RECIPE_INSTALL_HINT}")
        codecs.setdefault(CompletionsCodec.name, CompletionsCodec())
        self.codecs = codecs
        self.config = config
        self.engine = engine
        self.host = host
        self.metrics = ServerMetrics(config.model_name)
        self.front = (
            front
            if front is not None
            else EngineFront(
                engine,
                max_queue=config.max_queue,
                on_output=self.metrics.on_output,
                on_step=self.metrics.on_step,
                on_abort=self.metrics.on_abort,
                on_early_stop=self.metrics.on_early_stop,
            )
        )
        files = getattr(engine, "files", None)
        if config.sampling_defaults == "model" and files is not None:
            self.sampling_defaults = model_sampling_defaults(files.source, files)
        else:
            self.sampling_defaults = SamplingDefaults()
        log.info("sampling defaults for requests that leave them unset: %s", self.sampling_defaults.describe())
        self.preparer = ConversationPreparer(engine, host, self.sampling_defaults)
        self.warm_up = None  # the encoding's warm-up thread, once the app has started
        self.inspector = PromptInspector(self)
        self.app = self._build_app()

    def _build_app(self):
        from fastapi import FastAPI
        from fastapi.responses import PlainTextResponse

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.front.start()
            self.warm_up = self.preparer.start_warm_up()
            try:
                yield
            finally:
                self.front.shutdown()

        app = FastAPI(
            title="deepinfer",
            lifespan=lifespan,
            docs_url=None,  # web.py serves Swagger UI from local files
            redoc_url=None,
            openapi_url="/openapi.json",  # FastAPI adds the request's root_path (--root-path) to its servers
        )
        for codec in self.codecs.values():
            for method, path in codec.routes:
                app.add_route(path, ProtocolRoute(self, codec), methods=[method], include_in_schema=False)
        app.add_api_route("/v1/models", self.models, methods=["GET"], summary="The served model")
        app.add_api_route("/v1/plugins", self.plugins, methods=["GET"], summary="Installed plugins")
        app.add_api_route(
            "/v1/inspect",
            self.inspect,
            methods=["POST"],
            summary="The rendered prompt, its tokens and cached blocks, and what the parser extracts",
            description=(InspectBody.__doc__ or "") + "\n\n" + (inspect_module.__doc__ or ""),
            responses={
                400: {"description": "a bad body, in the named endpoint's error shape (the message names the field)"}
            },
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/InspectBody"}}},
                }
            },
        )
        app.add_api_route("/health", self.health, methods=["GET"], summary="Liveness and engine load")
        app.add_api_route(
            "/metrics",
            self.render_metrics,
            methods=["GET"],
            summary="Prometheus metrics",
            response_class=PlainTextResponse,
        )
        add_web_routes(app, self)
        app.openapi = lambda: build_openapi(app, self)
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

    async def inspect(self, request: Request):
        """``POST /v1/inspect`` (serve/inspect.py); errors in the named endpoint's own shape."""
        from fastapi.responses import JSONResponse

        codec = self.codecs.get("openai.chat_completions") or self.codecs[CompletionsCodec.name]
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, RecursionError) as exc:
                raise ProtocolError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
            codec = self.inspector.codec_for(body) or codec
            return JSONResponse(await self.inspector.inspect(body))
        except ProtocolError as error:
            status, payload = codec.render_error(error)
            return JSONResponse(payload, status_code=status)

    async def plugins(self):
        """Every discovered plugin, and whether it is usable here (and if not, why): what
        ``deepinfer plugins`` prints, from this server's own plugin host."""
        import asyncio

        infos = await asyncio.to_thread(self.host.plugins)  # a first probe may take a moment
        return {
            "object": "list",
            "data": [
                {
                    "name": i.name,
                    "distribution": i.distribution,
                    "version": i.version,
                    "builtin": i.builtin,
                    "usable": i.usable,
                    "reason": i.reason,
                    "note": i.note,
                    "contract": i.contract,
                    "hooks": [h.removeprefix("deepinfer_register_").removeprefix("deepinfer_") for h in i.hooks],
                }
                for i in infos
            ],
        }

    async def health(self):
        from fastapi.responses import JSONResponse

        return JSONResponse({"status": "ok", "in_flight": self.front.in_flight, **self.front.stats})

    async def render_metrics(self):
        from fastapi.responses import Response

        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

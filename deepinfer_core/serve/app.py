"""The ASGI application: one route per codec route, plus models, health and metrics.

Each protocol route is a :class:`~.exchange.ProtocolRoute` (parse, prepare, submit, answer in
the codec's shape); this module holds the server's state and the plain routes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from .completions import CompletionsCodec
from .conversation import ConversationPreparer
from .exchange import ProtocolRoute
from .front import EngineFront
from .metrics import ServerMetrics
from .sampling_defaults import SamplingDefaults, model_sampling_defaults

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

    def __init__(self, engine, host, config: ServerConfig) -> None:
        codecs = {name: factory() for name, factory in host.protocols().items()}
        if not codecs:
            raise NoProtocolCodecs(f"deepinfer serve: no protocol codecs are installed; {RECIPE_INSTALL_HINT}")
        codecs.setdefault(CompletionsCodec.name, CompletionsCodec())
        self.codecs = codecs
        self.config = config
        self.engine = engine
        self.metrics = ServerMetrics(config.model_name)
        self.front = EngineFront(
            engine,
            max_queue=config.max_queue,
            on_output=self.metrics.on_output,
            on_step=self.metrics.on_step,
            on_abort=self.metrics.on_abort,
            on_early_stop=self.metrics.on_early_stop,
        )
        files = getattr(engine, "files", None)
        if config.sampling_defaults == "model" and files is not None:
            self.sampling_defaults = model_sampling_defaults(files.source, files)
        else:
            self.sampling_defaults = SamplingDefaults()
        log.info("sampling defaults for requests that leave them unset: %s", self.sampling_defaults.describe())
        self.preparer = ConversationPreparer(engine, host, self.sampling_defaults)
        self.warm_up = None  # the encoding's warm-up thread, once the app has started
        self.app = self._build_app()

    def _build_app(self):
        from fastapi import FastAPI

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.front.start()
            self.warm_up = self.preparer.start_warm_up()
            try:
                yield
            finally:
                self.front.shutdown()

        app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        for codec in self.codecs.values():
            for method, path in codec.routes:
                app.add_route(path, ProtocolRoute(self, codec), methods=[method])
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

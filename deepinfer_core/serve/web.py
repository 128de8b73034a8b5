"""The browser side of the server: the web page at ``/``, ``/docs`` and ``/openapi.json``.

Everything is served from this machine (no CDN): the page's files live in ``serve/web/`` (package
data), Swagger UI's in the ``fastapi-offline`` wheel (Swagger UI 5, which reads OpenAPI 3.1).
Every URL the pages use is relative, and the page is served with a ``<base href>`` built from the
request's ``root_path``, so the whole UI works behind a proxy that mounts the server under a
prefix (``deepinfer serve --root-path /prefix``).
"""

from __future__ import annotations

import html
import importlib.resources
import importlib.util
from pathlib import Path

from .api_schema import protocol_paths
from .inspect import InspectBody

__all__ = ["WEB_DIR", "add_web_routes", "build_openapi"]

WEB_DIR = Path(__file__).parent / "web"
_BASE_MARK = "<!--base-->"


def build_openapi(app, server) -> dict:
    """FastAPI's schema of the plain routes, plus every codec route with its request body."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        schema = get_openapi(
            title="deepinfer",
            version=_version(),
            description="OpenAI- and Anthropic-compatible inference server. The web page is at `./`.",
            routes=app.routes,
        )
        paths, components = protocol_paths(server.codecs, server.config.model_name)
        schema["paths"] = {**paths, **schema.get("paths", {})}
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(components)
        schemas["InspectBody"] = InspectBody.model_json_schema()
        app.openapi_schema = schema
    return app.openapi_schema


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepinfer-core")
    except PackageNotFoundError:
        return "0"


def _base_href(request) -> str:
    root = request.scope.get("root_path", "") or ""
    return html.escape(root.rstrip("/") + "/", quote=True)


def add_web_routes(app, server) -> None:
    from fastapi.responses import HTMLResponse, RedirectResponse
    from fastapi.staticfiles import StaticFiles

    index = (WEB_DIR / "index.html").read_text(encoding="utf-8")

    async def page(request):
        body = index.replace(_BASE_MARK, f'<base href="{_base_href(request)}">', 1)
        return HTMLResponse(body, headers={"Cache-Control": "no-cache"})

    async def docs(request):
        return HTMLResponse(_docs_page(_base_href(request)))

    async def docs_slash(request):
        return RedirectResponse(_base_href(request) + "docs")

    app.add_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_route("/docs", docs, methods=["GET"], include_in_schema=False)
    app.add_route("/docs/", docs_slash, methods=["GET"], include_in_schema=False)
    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
    if importlib.util.find_spec("fastapi_offline") is not None:
        swagger = importlib.resources.files("fastapi_offline") / "static"
        app.mount("/docs-assets", StaticFiles(directory=str(swagger)), name="docs-assets")


def _docs_page(base: str) -> str:
    """Swagger UI from the local ``fastapi-offline`` files; without them, a short page that says
    what to install and links the schema."""
    if importlib.util.find_spec("fastapi_offline") is None:
        return (
            f'<!doctype html><html lang="en"><head><base href="{base}"><title>deepinfer API</title></head><body>'
            "<h1>deepinfer API</h1><p>The interactive reference needs the <code>fastapi-offline</code> package "
            "(<code>pip install 'deepinfer-core[serve]'</code>). The schema: "
            '<a href="openapi.json">openapi.json</a>.</p></body></html>'
        )
    from fastapi.openapi.docs import get_swagger_ui_html

    page = get_swagger_ui_html(
        openapi_url="openapi.json",
        title="deepinfer API",
        swagger_js_url="docs-assets/swagger-ui-bundle.js",
        swagger_css_url="docs-assets/swagger-ui.css",
        swagger_favicon_url="docs-assets/favicon.png",
    )
    return page.body.decode().replace("<head>", f'<head>\n<base href="{base}">', 1)

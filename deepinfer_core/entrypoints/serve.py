"""``deepinfer serve``: the HTTP server on uvicorn (uvloop / httptools where installed).

Top-level imports stay light (the CLI imports this module to build its parser); the engine,
FastAPI and uvicorn load in :func:`run`. SIGTERM drains: uvicorn stops accepting, lets
in-flight requests finish for ``--drain-timeout`` seconds, cancels the rest (their engine
requests are aborted), and the process exits 0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
import sys

from .engine_options import DEFAULT_MODEL, add_engine_options, add_model_option, engine_kwargs

__all__ = ["DEFAULT_MODEL", "add_parser", "run", "serve"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI / Anthropic APIs)",
        description="Serve a model over HTTP with the protocol codecs installed plugins register. "
        "The port is bound before the model loads, so a port in use is reported at once.",
    )
    add_model_option(p)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface (default: %(default)s)"
    )
    p.add_argument("--port", type=_port, default=8000, help="TCP port to listen on, 1-65535 (default: %(default)s)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait beyond the running batch before 429 (default: %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests (default: %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send its request body before a 408 (default: %(default)s)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's line and headers (from connecting, or from "
        "the previous response on a kept-alive connection) before the connection is closed (default: %(default)s)",
    )
    p.add_argument(
        "--sampling-defaults",
        default="model",
        choices=("model", "protocol"),
        help="for requests that leave temperature / top_p / top_k unset: the model's recommendation "
        "(generation_config.json, "
        "GGUF general.sampling.*, the embedded model's card) or each API's documented defaults (default: %(default)s)",
    )
    p.add_argument(
        "--root-path",
        default="",
        type=_root_path,
        help="the path prefix a reverse proxy serves this server under, e.g. /deepinfer: the web page, "
        "/docs and /openapi.json then link under it (default: none)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default: %(default)s)",
    )
    add_engine_options(p)
    p.set_defaults(func=run)
    return p


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {text!r}")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {value}")
    return value


def _root_path(text: str) -> str:
    if text and not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"a root path starts with '/', got {text!r}")
    return text.rstrip("/")


def bind(host: str, port: int) -> socket.socket:
    """The listening address, bound now (before the model loads: a port in use costs no load);
    uvicorn listens on it once the engine is up. OSError when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and asyncio do
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _fail(message: str) -> int:
    print(f"deepinfer serve: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return _fail(f"the server needs {exc.name}: pip install 'deepinfer-core[serve]'")
    from ..plugin_host import default_host

    host = default_host()
    if not host.protocols():
        from ..serve.app import RECIPE_INSTALL_HINT

        return _fail(f"no protocol codecs are installed; {RECIPE_INSTALL_HINT}")
    if not args.body_timeout > 0:
        return _fail(f"--body-timeout must be > 0 seconds, got {args.body_timeout}")
    if not args.header_timeout > 0:
        return _fail(f"--header-timeout must be > 0 seconds, got {args.header_timeout}")
    if args.max_queue < 0:
        return _fail(f"--max-queue must be >= 0, got {args.max_queue}")
    from ..engine.config import engine_config
    from ..engine.llm_engine import LLMEngine
    from ..serve.app import Server, ServerConfig

    try:
        config = engine_config(args.model, **engine_kwargs(args))
    except (ValueError, TypeError) as exc:
        return _fail(str(exc))
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    try:
        if config.world_size > 1:  # one endpoint over every rank: requests go to the least-loaded DP rank
            from ..engine.parallel.driver import ParallelEngine, ParallelGroupError

            try:
                engine = ParallelEngine(config, host)
            except ParallelGroupError as exc:
                raise ValueError(str(exc)) from None
        else:
            engine = LLMEngine(config, host)
    except (ValueError, TypeError, OSError, LookupError) as exc:
        sock.close()
        return _fail(str(exc))
    server = Server(
        engine,
        host,
        ServerConfig(
            model_name=args.served_model_name or args.model,
            max_queue=args.max_queue,
            sampling_defaults=args.sampling_defaults,
            body_timeout_s=args.body_timeout,
        ),
    )
    # This process serves the engine until it exits: what start-up made (imports, the engine, the
    # app) leaves the collector's view, so an automatic full collection walks only what requests
    # made since; over the start-up heap it stalls every request in flight (~130 ms on the default
    # model, benchmarks/serve/gc_pause.py; 100-130 ms in the H200 runs).
    gc.collect()
    gc.freeze()
    logging.getLogger("deepinfer.serve").info("deepinfer serve: listening on http://%s:%d", args.host, args.port)
    serve(server.app, sock, args.drain_timeout, args.log_level, args.root_path, args.header_timeout)
    if engine.tiers is not None:  # queued KV write-backs reach the store before exit
        engine.tiers.flush(timeout=args.drain_timeout + 30)
    if hasattr(engine, "shutdown"):  # a parallel engine's rank processes
        engine.shutdown()
    return 0


def uvicorn_config(
    app,
    host: str,
    port: int,
    *,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    root_path: str = "",
    header_timeout: float = 30.0,
):
    """The uvicorn configuration ``deepinfer serve`` runs with: uvicorn's own HTTP protocol
    (httptools where installed, else h11) with the request-header deadline added."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from ..serve.header_deadline import with_header_deadline

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=drain_timeout,
        root_path=root_path,
        http=with_header_deadline(AutoHTTPProtocol, header_timeout),
    )


def serve(
    app,
    sock: socket.socket,
    drain_timeout: float,
    log_level: str = "info",
    root_path: str = "",
    header_timeout: float = 30.0,
) -> None:
    """Run ``app`` on the bound socket ``sock`` until SIGTERM / SIGINT (then drain)."""
    import uvicorn

    # uvicorn re-raises the signal that stopped it once it has drained; with a Python handler
    # in place that re-raise is harmless and a drained server exits 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        host, port = sock.getsockname()[:2]
        config = uvicorn_config(
            app,
            host,
            port,
            drain_timeout=drain_timeout,
            log_level=log_level,
            root_path=root_path,
            header_timeout=header_timeout,
        )
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()

"""``deepinfer serve``: the HTTP server on uvicorn (uvloop / httptools where installed).

Top-level imports stay light (the CLI imports this module to build its parser); the engine,
FastAPI and uvicorn load in :func:`run`. SIGTERM drains: uvicorn stops accepting, lets
in-flight requests finish for ``--drain-timeout`` seconds, cancels the rest (their engine
requests are aborted), and the process exits 0.
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys

from ..engine.kv_dtype_names import KV_CACHE_DTYPES
from ..kv_store.url import add_kv_store_arguments

DEFAULT_MODEL = "smollm2-135m-instruct"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI / Anthropic APIs)",
        description="Serve a model over HTTP with the protocol codecs installed plugins register.",
    )
    p.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help="path to a GGUF file / HF directory, or an installed alias (default: %(default)s)",
    )
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
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
        "--sampling-defaults",
        default="model",
        choices=("model", "protocol"),
        help="for requests that leave temperature / top_p / top_k unset: the model's recommendation (generation_config.json, "
        "GGUF general.sampling.*, the embedded model's card) or each API's documented defaults (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    engine = p.add_argument_group("engine options")
    engine.add_argument("--device", default="auto")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache elements on the low-bit CPU path (int8: opt-in, half float16's bytes; default: %(default)s)",
    )
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--kv-cache-blocks", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=128)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--seed", type=int, default=0)
    add_kv_store_arguments(engine)
    p.set_defaults(func=run)
    return p


def _fail(message: str) -> int:
    print(f"deepinfer serve: {message}", file=sys.stderr)
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
        return _fail(
            "no protocol codecs are installed; install the deepinfer-recipe package (pip install deepinfer-recipe)"
        )
    if args.max_queue < 0:
        return _fail(f"--max-queue must be >= 0, got {args.max_queue}")
    from ..engine.config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..serve.app import Server, ServerConfig

    try:
        config = EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_blocks=args.kv_cache_blocks,
            block_size=args.block_size, max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
            kv_store=args.kv_store, kv_store_gib=args.kv_store_gib,
        )  # fmt: skip
        engine = LLMEngine(config, host)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        return _fail(f"error: {exc}")
    server = Server(
        engine,
        host,
        ServerConfig(
            model_name=args.served_model_name or args.model,
            max_queue=args.max_queue,
            sampling_defaults=args.sampling_defaults,
        ),
    )
    # This process serves the engine until it exits: what start-up made (imports, the engine, the
    # app) leaves the collector's view, so an automatic full collection walks only what requests
    # made since; over the start-up heap it stalls every request in flight (~130 ms on the default
    # model, benchmarks/serve/gc_pause.py; 100-130 ms in the H200 runs).
    gc.collect()
    gc.freeze()
    serve(server.app, args.host, args.port, args.drain_timeout, args.log_level)
    if engine.tiers is not None:  # queued KV write-backs reach the store before exit
        engine.tiers.flush(timeout=args.drain_timeout + 30)
    return 0


def serve(app, host: str, port: int, drain_timeout: float, log_level: str = "info") -> None:
    import uvicorn

    # uvicorn re-raises the signal that stopped it once it has drained; with a Python handler
    # in place that re-raise is harmless and a drained server exits 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
    finally:
        signal.signal(signal.SIGTERM, previous)

"""`deepinfer serve` moves everything start-up made out of the garbage collector's view before it
takes requests (entrypoints/serve.py): a full collection then walks only what requests made, not the
start-up heap whose collection stalls every request in flight (benchmarks/serve/gc_pause.py)."""

from __future__ import annotations

import argparse
import gc
import socket

from deepinfer_core.entrypoints import serve as serve_cli


def test_serve_freezes_the_start_up_heap_before_serving(monkeypatch):
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    with socket.socket() as probe:  # serve binds its port before loading: a free one
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    args = parser.parse_args(
        ["serve", "--port", port, "--max-model-len", "512", "--kv-cache-blocks", "16", "--max-num-seqs", "2"]
    )
    seen = {}

    def fake_serve(app, sock, drain_timeout, log_level="info", root_path="", header_timeout=30.0):
        sock.close()
        seen["frozen"] = gc.get_freeze_count()
        seen["engine_frozen"] = not any(type(o).__name__ == "LLMEngine" for o in gc.get_objects())

    monkeypatch.setattr(serve_cli, "serve", fake_serve)
    gc.unfreeze()
    try:
        assert serve_cli.run(args) == 0
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
    assert seen["frozen"] > 10_000  # imports, the engine, the app
    assert seen["engine_frozen"]  # the engine is no longer among the objects a collection walks

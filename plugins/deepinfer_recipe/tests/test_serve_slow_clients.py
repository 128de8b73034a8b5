"""Clients that hang up mid-body, or send it too slowly (issue 31.8): the server logged a
traceback as an internal error ("preparing a request failed") for every client that disconnected
before its body arrived (Starlette's ClientDisconnect), and waited forever for a slow body."""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from serve_harness import MODEL

HEAD = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"


def _connect(served) -> socket.socket:
    url = urlsplit(served.base_url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def test_a_client_that_hangs_up_mid_body_is_logged_as_a_disconnect_not_an_error(served, caplog):
    caplog.set_level(logging.INFO, logger="deepinfer_core")
    for _ in range(3):
        with _connect(served) as sock:
            sock.sendall((HEAD + '{"model": "').encode())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum("disconnected before" in r.getMessage() for r in caplog.records) < 3:
        time.sleep(0.05)
    said = [r for r in caplog.records if r.name.startswith("deepinfer_core")]
    assert sum("disconnected before sending its whole request body" in r.getMessage() for r in said) == 3
    assert not [r for r in said if r.levelno >= logging.WARNING], [r.getMessage() for r in said]
    assert served.health()["in_flight"] == 0


def test_a_body_that_does_not_arrive_in_time_gets_a_408_and_the_server_goes_on(served, monkeypatch):
    monkeypatch.setattr(served.server, "config", dataclasses.replace(served.server.config, body_timeout_s=0.5))
    with _connect(served) as sock:
        sock.sendall((HEAD + "{").encode())  # and then nothing
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 408"), reply[:200]
    assert "did not arrive within 0.5 s" in reply
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200


# -- the request-header deadline (slowloris) -------------------------------------------------


async def _slow_app(scope, receive, send):
    """An ASGI app answering after ``?sleep`` seconds (default 0)."""
    import asyncio

    if scope["type"] != "http":
        return
    query = scope.get("query_string", b"").decode()
    if query.startswith("sleep="):
        await asyncio.sleep(float(query.split("=", 1)[1]))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=["httptools", "h11"])
def deadline_server(request):
    """uvicorn with ``deepinfer serve``'s configuration (header timeout 0.5 s), on each of
    uvicorn's HTTP implementations, serving a trivial app in a thread."""
    import threading

    import uvicorn
    from serve_harness import free_port

    from deepinfer_core.entrypoints.serve import uvicorn_config
    from deepinfer_core.serve.header_deadline import with_header_deadline

    port = free_port()
    config = uvicorn_config(_slow_app, "127.0.0.1", port, log_level="warning", header_timeout=0.5)
    if request.param == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        config.http = with_header_deadline(H11Protocol, 0.5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.02)
    assert request.param.lower()[:2] in server.config.http_protocol_class.__name__.lower()
    yield port
    server.should_exit = True
    thread.join(10)


def _closed_by_server(sock: socket.socket) -> float:
    """Seconds until the server closes ``sock`` (reads until EOF; the socket's own timeout
    fails the test if it never does)."""
    start = time.monotonic()
    while sock.recv(4096):
        pass
    return time.monotonic() - start


def test_headers_that_do_not_arrive_in_time_close_the_connection(deadline_server, caplog):
    caplog.set_level(logging.INFO, logger="deepinfer_core.serve")
    with socket.create_connection(("127.0.0.1", deadline_server), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and then nothing: the blank line never comes
        assert 0.3 < _closed_by_server(sock) < 4
    with socket.create_connection(("127.0.0.1", deadline_server), timeout=5) as sock:  # says nothing at all
        assert _closed_by_server(sock) < 4
    assert any("did not arrive within 0.5 s" in r.getMessage() for r in caplog.records)


def test_the_deadline_spares_complete_requests_slow_answers_and_kept_alive_connections(deadline_server):
    with socket.create_connection(("127.0.0.1", deadline_server), timeout=5) as sock:
        for part in (b"GET /?sleep=1.2 HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):  # headers in 0.4 s, in time
            sock.sendall(part)
            time.sleep(0.2)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # an answer slower than the deadline is not cut
        for _ in range(3):  # the deadline restarts after each response on a kept-alive connection
            time.sleep(0.3)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\n")  # then a request whose headers stall
        assert _closed_by_server(sock) < 4


def test_serve_refuses_a_header_timeout_that_is_not_positive(capsys):
    import argparse

    from serve_harness import free_port

    from deepinfer_core.entrypoints import serve as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--port", str(free_port()), "--header-timeout", "0"])
    assert serve_cli.run(args) == 2
    assert "--header-timeout must be > 0 seconds, got 0.0" in capsys.readouterr().err

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

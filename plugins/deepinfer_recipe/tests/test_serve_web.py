"""The web page at ``/`` in a real headless Chromium (Playwright), against a real server
(SmolLM2) started with root path ``/deepinfer`` (``--root-path``) behind a reverse proxy that
serves it under that prefix. What the page shows is checked against the server's own answers to
the official ``openai`` SDK. Screenshots of every view go to ``$WEB_SCREENSHOT_DIR`` (default: a temporary folder; the
ones in ``docs/web/`` are refreshed with ``WEB_SCREENSHOT_DIR=docs/web``).

The browser: :mod:`web_browser` (Debian's ``chromium``, which ``.ci/run`` installs)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_harness import ENGINE_ARGS, MAX_QUEUE, MODEL, free_port
from web_browser import Console, launch_chromium, wait_idle

PREFIX = "/deepinfer"
CLUSTER = {  # what a `deepinfer cluster` front would report (the view renders any such JSON)
    "replicas": [
        {"name": "prefill-0", "role": "prefill", "running": 1, "waiting": 0, "resident_kv_blocks": 12},
        {"name": "decode-0", "role": "decode", "running": 3, "waiting": 1, "resident_kv_blocks": 40},
    ],
    "router_decisions": [{"request": "r1", "replica": "prefill-0", "reason": "longest cached prefix"}],
}


def _serve_in_thread(app, **config):
    import uvicorn

    userver = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", **config))
    thread = threading.Thread(target=userver.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not userver.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.05)
    return userver, thread, f"http://127.0.0.1:{userver.config.port}"


def _stripping_proxy(backend: str):
    """A reverse proxy as nginx's ``location /deepinfer/ { proxy_pass http://backend/; }``:
    forwards PREFIX/... to the backend's /..., streaming the answers; anything else is a 404."""
    from starlette.responses import PlainTextResponse, StreamingResponse

    client = httpx.AsyncClient(base_url=backend, timeout=None)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"]
        if not path.startswith(PREFIX + "/"):
            return await PlainTextResponse("not found", status_code=404)(scope, receive, send)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        query = scope["query_string"].decode()
        request = client.build_request(
            scope["method"],
            path[len(PREFIX) :] + (f"?{query}" if query else ""),
            headers=[(k.decode(), v.decode()) for k, v in scope["headers"] if k not in (b"host", b"content-length")],
            content=body,
        )
        upstream = await client.send(request, stream=True)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()  # the browser went away: so does the backend's stream

        headers = {
            k: v for k, v in upstream.headers.items() if k.lower() not in ("content-length", "transfer-encoding")
        }
        response = StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)
        await response(scope, receive, send)

    return app


@pytest.fixture(scope="module")
def prefixed():
    """A server started with root path PREFIX (and a GET /cluster route) behind a proxy that
    serves it under PREFIX; yields the proxy's URL (the page is at PREFIX/)."""
    from deepinfer_core.engine.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.plugin_host import default_host
    from deepinfer_core.serve.app import Server, ServerConfig

    host = default_host()
    engine = LLMEngine(EngineConfig(model=MODEL, **ENGINE_ARGS), host)
    server = Server(engine, host, ServerConfig(model_name=MODEL, max_queue=MAX_QUEUE))

    async def cluster():
        return CLUSTER

    server.app.add_api_route("/cluster", cluster, methods=["GET"])
    backend, backend_thread, backend_url = _serve_in_thread(server.app, root_path=PREFIX)
    proxy, proxy_thread, proxy_url = _serve_in_thread(_stripping_proxy(backend_url))
    yield proxy_url
    for userver, thread in ((proxy, proxy_thread), (backend, backend_thread)):
        userver.should_exit = True
        thread.join(60)


@pytest.fixture(scope="module")
def browser():
    yield from launch_chromium()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("WEB_SCREENSHOT_DIR") or tmp_path_factory.mktemp("web-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"web screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def page(browser, prefixed):
    """One tab on the prefixed server, shared by the tests below in order (as one user would)."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    tab = context.new_page()
    tab.console = Console(tab)
    tab.goto(f"{prefixed}{PREFIX}/")
    tab.wait_for_selector("body[data-ready=true]", timeout=30_000)
    yield tab
    context.close()


def _oai(prefixed):
    import openai

    return openai.OpenAI(base_url=f"{prefixed}{PREFIX}/v1", api_key="unused", max_retries=0, timeout=120)


def _reference(prefixed, question: str) -> str:
    reply = _oai(prefixed).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24
    )
    return reply.choices[0].message.content


def test_chat_streams_the_reply_keyboard_only(page, prefixed, shots):
    question = "What is the capital of France?"
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.focus("#prompt")
    page.keyboard.type(question)
    page.keyboard.press("Enter")  # sends; Shift+Enter would be a new line
    page.wait_for_selector(".msg.assistant", timeout=30_000)
    lengths = set()
    while page.is_disabled("#send"):  # the reply grows while it streams
        lengths.add(len(page.inner_text(".msg.assistant .content")))
        time.sleep(0.02)
    shown = page.inner_text(".msg.assistant .content")
    assert len(lengths) > 2, lengths
    assert shown == _reference(prefixed, question)  # what the server answers the official SDK
    page.screenshot(path=str(shots / "chat.png"))


def test_edit_regenerate_and_conversations_persist(page, prefixed, tmp_path):
    first = page.inner_text(".msg.assistant .content")
    page.click("#regenerate")  # temperature 0: the same reply again, replacing the old one
    wait_idle(page)
    assert page.locator(".msg.assistant").count() == 1
    assert page.inner_text(".msg.assistant .content") == first
    page.click(".msg.user .actions button")  # edit and resend: the turn comes back to the box
    assert page.input_value("#prompt") == "What is the capital of France?"
    assert page.locator(".msg").count() == 0
    page.fill("#prompt", "What is the capital of Italy?")
    page.press("#prompt", "Enter")
    wait_idle(page)
    italy = page.inner_text(".msg.assistant .content")
    assert italy == _reference(prefixed, "What is the capital of Italy?")  # not the France turn's context
    page.reload()  # kept in IndexedDB
    page.wait_for_selector("body[data-ready=true]")
    assert "What is the capital of Italy?" in page.inner_text("#conversation-list")
    with page.expect_download() as download:
        page.click("#export-chats")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["conversations"][0]["messages"][0]["content"] == "What is the capital of Italy?"
    imported = {
        "conversations": [{"id": "imported-1", "title": "From a file", "messages": [{"role": "user", "content": "x"}]}]
    }
    (tmp_path / "chats.json").write_text(json.dumps(imported))
    page.set_input_files("#import-chats", str(tmp_path / "chats.json"))
    page.wait_for_function("document.querySelector('#conversation-list').innerText.includes('From a file')")
    page.click("#conversation-list button.open >> text=What is the capital of Italy?")
    assert page.inner_text(".msg.assistant .content") == italy


def test_stop_ends_the_stream_and_the_request(page, prefixed):
    page.fill("#max-tokens", "800")
    page.fill("#prompt", "Write a very long story about a dragon, with many chapters.")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "[...document.querySelectorAll('.msg.assistant .content')].pop().innerText.length > 20",
        timeout=60_000,
    )
    page.keyboard.press("Tab")  # from the message box: Send (disabled, skipped) then Stop
    assert page.evaluate("document.activeElement.id") == "stop"
    page.keyboard.press("Enter")
    wait_idle(page)
    assert "stopped" in page.locator(".msg.assistant .meta").last.inner_text()
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{prefixed}{PREFIX}/health", timeout=10).json())["in_flight"] or health["running"]:
        assert time.monotonic() < deadline, health  # the server aborted the request
        time.sleep(0.1)
    page.fill("#max-tokens", "24")


def test_inspector_highlights_special_tokens(page, prefixed, shots):
    last_reply = page.locator(".msg.assistant .content").last.inner_text()
    page.click("#tab-inspector")
    page.click("#inspect-load")
    page.click("#inspect-run")
    page.wait_for_selector("#inspect-prompt .special", timeout=30_000)
    specials = page.locator("#inspect-prompt .special").all_inner_texts()
    assert "<|im_start|>" in specials and "<|im_end|>" in specials
    messages = json.loads(page.input_value("#inspect-messages"))
    report = httpx.post(f"{prefixed}{PREFIX}/v1/inspect", json={"request": {"messages": messages}}, timeout=30).json()
    assert page.inner_text("#inspect-ids").split() == [str(t["id"]) for t in report["prompt"]["tokens"]]
    assert (
        page.locator("#inspect-blocks .tier-device").count() == sum(b["tier"] == "device" for b in report["blocks"]) > 0
    )
    parsed = page.locator("#inspect-parsed td").first.inner_text()
    assert parsed.strip() == last_reply.strip()  # the last reply, through the parser
    page.screenshot(path=str(shots / "inspector.png"), full_page=True)


def test_metrics_move(page, prefixed, shots):
    page.click("#tab-metrics")
    page.wait_for_function("document.querySelector('[data-metric=generated]').innerText !== '–'")
    before = int(page.inner_text("[data-metric=generated]"))
    reply = _oai(prefixed).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 12
    page.wait_for_function(
        f"Number(document.querySelector('[data-metric=generated]').innerText) >= {before + 12}", timeout=10_000
    )
    page.wait_for_timeout(1200)  # one more sample for the charts
    page.screenshot(path=str(shots / "metrics.png"))


def test_plugins_view(page, shots):
    page.click("#tab-plugins")
    page.wait_for_selector("#plugin-rows tr")
    rows = page.inner_text("#plugin-rows")
    assert "recipe" in rows and "core.platforms" in rows
    page.screenshot(path=str(shots / "plugins.png"))


def test_cluster_view(page, shots):
    page.click("#tab-cluster")
    page.wait_for_selector("#cluster-body table")
    text = page.inner_text("#cluster-body")
    assert "decode-0" in text and "longest cached prefix" in text
    page.screenshot(path=str(shots / "cluster.png"))


def test_every_control_is_labelled_and_no_console_errors(page):
    page.click("#tab-chat")
    snapshot = page.locator("body").aria_snapshot()
    controls = re.findall(r"^\s*- (button|textbox|checkbox|spinbutton|combobox|tab|link)\b(.*)$", snapshot, re.M)
    assert len(controls) > 15
    unlabeled = [f"{role}{rest}" for role, rest in controls if not rest.strip().startswith('"')]
    assert not unlabeled, unlabeled
    assert page.console.errors == []


def test_bad_input_shows_the_servers_message(browser, prefixed):
    context = browser.new_context()
    tab = context.new_page()
    tab.goto(f"{prefixed}{PREFIX}/")
    tab.wait_for_selector("body[data-ready=true]")
    tab.fill("#max-tokens", "4")
    tab.check("#use-schema")
    tab.fill("#json-schema", '{"type": "nonsense"}')
    tab.fill("#prompt", "Hi")
    tab.press("#prompt", "Enter")
    tab.wait_for_selector("#chat-error:not([hidden])")
    assert "response_format.json_schema.schema" in tab.inner_text("#chat-error")
    assert "nonsense" in tab.inner_text("#chat-error")
    tab.uncheck("#use-schema")
    tab.fill("#prompt", "word " * 3000)  # far past the 1024-token context
    tab.press("#prompt", "Enter")
    tab.wait_for_function("document.querySelector('#chat-error').innerText.includes('context')")
    assert "1024" in tab.inner_text("#chat-error")
    tab.click("#tab-inspector")
    tab.fill("#inspect-messages", '[{"role": "robot", "content": "x"}]')
    tab.click("#inspect-run")
    tab.wait_for_selector("#inspect-error:not([hidden])")
    assert "messages[0].role" in tab.inner_text("#inspect-error")
    context.close()


def test_prefix_and_root(prefixed, served, browser):
    page = httpx.get(f"{prefixed}{PREFIX}/", timeout=10).text
    assert f'<base href="{PREFIX}/">' in page  # every URL of the page resolves under the prefix
    assert httpx.get(f"{prefixed}/v1/models", timeout=10).status_code == 404  # only PREFIX/ reaches the server
    assert httpx.get(f"{prefixed}{PREFIX}/openapi.json", timeout=10).json()["servers"] == [{"url": PREFIX}]
    # at the root, with no GET /cluster: no cluster tab
    context = browser.new_context()
    tab = context.new_page()
    console = Console(tab)
    tab.goto(f"{served.base_url}/")
    tab.wait_for_selector("body[data-ready=true]")
    assert tab.is_hidden("#tab-cluster")
    assert MODEL in tab.inner_text("#model-name")
    tab.goto(f"{served.base_url}/docs")
    tab.wait_for_selector(".opblock", timeout=30_000)  # Swagger UI rendered the schema, offline
    assert "/v1/chat/completions" in tab.inner_text("body")
    assert console.errors == []
    context.close()

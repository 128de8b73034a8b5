"""Refusals in each protocol's own shape, overload (429), client disconnects and SIGTERM.

Every refusal must leave the server serving: each test ends with the server idle and a normal
request still answered."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest
from serve_harness import ENGINE_ARGS, MAX_QUEUE, MODEL, start_subprocess

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 200  # ~2,000 tokens, context is 1,024


def assert_error_shape(path: str, response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["message"], body
        return body["error"]
    assert body["error"]["message"] and body["error"]["type"], body
    return body["error"]


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.base_url, timeout=300) as client:
        yield client


@pytest.fixture(autouse=True)
def still_serving(served, http):
    yield
    health = served.wait_idle()
    assert (health["in_flight"], health["running"], health["waiting"], health["kv_usage"]) == (0, 0, 0, 0.0), health
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("path", list(BODIES))
def test_bad_json(http, path):
    error = assert_error_shape(
        path, http.post(path, content=b'{"model": ', headers={"content-type": "application/json"}), 400
    )
    assert "JSON" in error["message"]


@pytest.mark.parametrize("path", list(BODIES))
def test_wrong_types(http, path):
    body = {**BODIES[path], "max_tokens": "many", "max_output_tokens": "many"}
    error = assert_error_shape(path, http.post(path, json=body), 400)
    assert "max_" in error["message"]
    assert_error_shape(path, http.post(path, json=[1, 2]), 400)


@pytest.mark.parametrize("path", list(BODIES))
def test_unknown_model(http, path):
    error = assert_error_shape(path, http.post(path, json={**BODIES[path], "model": "gpt-17"}), 404)
    assert "gpt-17" in error["message"]


def test_unknown_model_through_the_sdks(served):
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "Hi"}]
        )
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=served.base_url, api_key="x", max_retries=0).messages.create(
            model="nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )


@pytest.mark.parametrize("path", list(BODIES))
def test_prompt_longer_than_the_context(http, path):
    body = dict(BODIES[path])
    if path == "/v1/completions":
        body["prompt"] = LONG_PROMPT
    elif path == "/v1/responses":
        body["input"] = LONG_PROMPT
    else:
        body["messages"] = [{"role": "user", "content": LONG_PROMPT}]
    error = assert_error_shape(path, http.post(path, json=body), 400)
    assert "1024" in error["message"] and "context" in error["message"]


def test_prompt_too_long_through_the_sdk(served):
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}])
    assert info.value.code == "context_length_exceeded"


OUTPUT_LIMIT = {
    "/v1/chat/completions": "max_completion_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
    "/v1/completions": "max_tokens",
}


@pytest.mark.parametrize("path", list(BODIES))
def test_output_limit_past_the_context_is_refused(http, path):
    """prompt + the output limit over the 1,024-token context: 400 in the protocol's shape
    naming the field (under the name the client used) and the limit, as OpenAI and Anthropic
    answer (it was capped silently). The largest value the message allows is accepted."""
    param = OUTPUT_LIMIT[path]
    body = {key: value for key, value in BODIES[path].items() if not key.startswith("max_")}
    error = assert_error_shape(path, http.post(path, json={**body, param: 1024}), 400)
    assert f"{param}=1024" in error["message"] and "maximum context length of 1024 tokens" in error["message"], error
    if path != "/v1/messages":
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    else:
        assert error["type"] == "invalid_request_error"
    most = int(error["message"].rsplit("at most ", 1)[1].split()[0])
    ok = http.post(path, json={**body, param: 1})  # usage gives the prompt's length independently
    assert ok.status_code == 200, ok.text
    usage = ok.json()["usage"]
    prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
    assert most == 1024 - prompt_tokens
    assert assert_error_shape(path, http.post(path, json={**body, param: most + 1}), 400)["message"]


def test_output_limit_past_the_context_through_the_sdks(oai, claude):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5000
        )
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_completion_tokens")
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=5000, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens=5000" in refused.value.body["error"]["message"]


def test_schema_xgrammar_cannot_compile(http):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
    }
    error = assert_error_shape(
        "/v1/chat/completions", http.post("/v1/chat/completions", json={**CHAT, "response_format": fmt}), 400
    )
    assert error["param"] == "response_format.json_schema.schema"
    assert "cannot be compiled" in error["message"]


def _open_stream(base_url: str, path: str, max_tokens: int) -> tuple[int, dict, httpx.Client, object]:
    client = httpx.Client(base_url=base_url, timeout=300)
    body = {**BODIES[path], "stream": True, "max_tokens": max_tokens, "max_output_tokens": max_tokens}
    body.pop("max_output_tokens" if path != "/v1/responses" else "max_tokens")
    cm = client.stream("POST", path, json={**body, "temperature": 1.0, "seed": 1})
    response = cm.__enter__()
    return response.status_code, response, client, cm


def _sample(base_url: str, name: str) -> float:
    lines = [line for line in httpx.get(f"{base_url}/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_full_queue_answers_429_with_retry_after(served):
    """Fill every slot with requests that cannot finish early (ignore_eos), then one more
    request per protocol: each is a 429 in its own error shape, with Retry-After."""
    capacity = ENGINE_ARGS["max_num_seqs"] + MAX_QUEUE
    filler = {**BODIES["/v1/completions"], "max_tokens": 400, "ignore_eos": True, "stream": True}
    rejected = 'deepinfer:requests_rejected_total{model_name="%s"}' % MODEL
    before = _sample(served.base_url, rejected)
    opened = []
    try:
        for _ in range(capacity):
            client = httpx.Client(base_url=served.base_url, timeout=300)
            cm = client.stream("POST", "/v1/completions", json=filler)
            opened.append((client, cm))
            assert cm.__enter__().status_code == 200
        for path, body in BODIES.items():
            response = httpx.post(f"{served.base_url}{path}", json=body, timeout=60)
            assert_error_shape(path, response, 429)
            assert int(response.headers["retry-after"]) >= 1
        assert _sample(served.base_url, rejected) == before + len(BODIES)
    finally:
        for client, cm in opened:
            cm.__exit__(None, None, None)
            client.close()


def test_fifty_disconnecting_clients_free_everything(served):
    def one(i: int) -> int:
        path = list(BODIES)[i % 4]
        status, response, client, cm = _open_stream(served.base_url, path, 300)
        try:
            if status == 200:
                next(response.iter_raw())  # the stream has started: then hang up
            return status
        finally:
            cm.__exit__(None, None, None)
            client.close()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(one, range(50)))
    assert statuses.count(200) >= 40, statuses
    health = served.wait_idle()
    assert (health["in_flight"], health["running"], health["waiting"], health["kv_usage"]) == (0, 0, 0, 0.0), health


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process, from /proc (Linux, as CI)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        table[int(entry)] = (int(fields[1]), fields[19])  # ppid, starttime (fields 4 and 22 of stat)
    return table


def _descendants(pid: int) -> dict[int, str]:
    table, found, frontier = _process_table(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def test_sigterm_drains_and_exits_zero():
    """SIGTERM mid-stream: the stream finishes, the server exits 0, and no process it started
    (at any depth) outlives it."""
    proc, url = start_subprocess()
    try:
        with (
            httpx.Client(base_url=url, timeout=120) as client,
            client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 20, "stream": True}) as response,
        ):
            assert response.status_code == 200
            children = _descendants(proc.pid)  # whatever the server runs while it serves
            proc.send_signal(signal.SIGTERM)  # mid-stream: the stream still finishes
            text = response.read().decode()
        assert text.rstrip().endswith("data: [DONE]")
        assert proc.wait(120) == 0
        table = _process_table()
        survivors = {
            pid for pid, start in children.items() if pid in table and table[pid][1] == start
        }  # same pid and start: the same process
        assert not survivors, f"processes the server started are still running: {survivors}"
        assert not _descendants(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_without_protocol_plugins_exits_at_once():
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.entrypoints", "serve", "--port", "1"],
        env={**os.environ, "DEEPINFER_PLUGINS": "none-installed"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "deepinfer-recipe" in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 10**9}, "top_logprobs"),
        ("/v1/responses", {"top_logprobs": 5}, "top_logprobs"),
        ("/v1/chat/completions", {"seed": 2**200}, "seed"),
        ("/v1/messages", {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ],
)
def test_fields_the_server_cannot_honour_are_refused_by_name(http, path, change, param):
    """Asked-for log probabilities were silently left out (200 with ``logprobs: null``); a seed
    out of range named no field; an empty Anthropic content list gave a message about lists."""
    error = assert_error_shape(path, http.post(path, json={**BODIES[path], **change}), 400)
    assert param in error["message"]
    if path != "/v1/messages":
        assert error["param"] == param

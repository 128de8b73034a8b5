"""Property test over HTTP: random and mutated request bodies on every endpoint are served
(200) or refused with the protocol's 4xx, never a 5xx; a stream started before the storm
finishes normally. Example counts stay small enough for CI (a few hundred requests)."""

from __future__ import annotations

import copy
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_harness import MODEL

VALID = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    "/v1/responses": {"model": MODEL, "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 3},
    "/v1/messages": {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 3},
}
KNOWN_KEYS = [
    "model",
    "messages",
    "input",
    "prompt",
    "role",
    "content",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "tools",
    "tool_choice",
    "response_format",
    "text",
    "thinking",
    "reasoning_effort",
    "seed",
    "n",
    "system",
    "instructions",
    "type",
    "stream_options",
    "metadata",
    "tool_calls",
    "tool_call_id",
    "name",
    "json_schema",
    "schema",
    "presence_penalty",
]
LIMIT_KEYS = ("max_tokens", "max_output_tokens", "max_completion_tokens")

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-5, 10**9)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _paths(child, prefix + (i,))


@st.composite
def mutated(draw, base: dict):
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["set", "delete", "add"]))
        if action == "delete" and path[-1] not in LIMIT_KEYS:  # no limit would mean a long generation
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(KNOWN_KEYS))] = draw(json_values)
        else:
            parent[path[-1]] = draw(json_values)
    for key in LIMIT_KEYS:  # a mutated limit stays small (a big one is valid and just slow)
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
            body[key] = 4
    return body


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.base_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def stream_in_flight(served):
    """A streamed chat request running through the whole property test."""
    result: dict = {}

    def run() -> None:
        with httpx.Client(base_url=served.base_url, timeout=600) as client:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
                "max_tokens": 300,
                "temperature": 0,
                "stream": True,
            }
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                result["status"] = response.status_code
                result["frames"] = [line for line in response.iter_lines() if line.startswith("data: ")]

    thread = threading.Thread(target=run)
    thread.start()
    yield result
    thread.join(600)
    assert result["status"] == 200
    frames = result["frames"]
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks).strip()


def _check(http, path: str, body) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with http.stream("POST", path, content=content, headers={"content-type": "application/json"}) as response:
        payload = response.read()
    assert response.status_code == 200 or 400 <= response.status_code < 500, (response.status_code, payload[:300], body)
    if response.status_code != 200 and path != "/v1/messages":
        assert json.loads(payload)["error"]["message"]
    elif response.status_code != 200:
        assert json.loads(payload)["type"] == "error"


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize("path", list(VALID))
def test_mutated_bodies_are_served_or_refused(http, stream_in_flight, path):
    @SETTINGS
    @given(mutated(VALID[path]))
    def check(body):
        _check(http, path, body)

    check()


@pytest.mark.parametrize("path", list(VALID))
def test_random_bodies_are_refused(http, stream_in_flight, path):
    @settings(SETTINGS, max_examples=10)
    @given(json_values | st.binary(max_size=40))
    def check(body):
        _check(http, path, body)

    check()

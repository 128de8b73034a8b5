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
from hypothesis.errors import Unsatisfiable
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


# -- OpenAPI-driven fuzz (schemathesis) ---------------------------------------------------------
# schemathesis generates bodies, queries and headers for every operation in the server's own
# ``/openapi.json``, both bodies the schema allows and bodies it rules out. Each response must not
# be a 5xx and must match what the schema documents (status code, content type, response schema
# where one is given); afterwards the server is unchanged: healthy, the same greedy text, and every
# KV block back in the pool.

GREEDY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 8,
    "temperature": 0,
}


def _kv_blocks_used(http) -> float:
    text = http.get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("deepinfer:kv_cache_usage_perc")]
    assert lines, "no deepinfer:kv_cache_usage_perc gauge on /metrics"
    return float(lines[0].rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def openapi_schema(served, http):
    import schemathesis

    served.wait_idle()  # the baseline is taken with nothing in flight (another test's stream may run)
    before = {
        "greedy": http.post("/v1/chat/completions", json=GREEDY).json()["choices"][0]["message"]["content"],
        "kv": _kv_blocks_used(http),
    }
    yield schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    served.wait_idle()
    assert http.get("/health").status_code == 200
    after = http.post("/v1/chat/completions", json=GREEDY).json()["choices"][0]["message"]["content"]
    assert after == before["greedy"]
    served.wait_idle()
    assert _kv_blocks_used(http) == before["kv"]


DEFAULT_LIMIT = {"/v1/chat/completions": "max_completion_tokens", "/v1/responses": "max_output_tokens"}


def _bounded(path: str, body):
    """Generation limits stay small: a large or absent ``max_tokens`` is valid, just slow on a CPU.
    Only integers are touched, so a negative case (a limit of ``0`` or ``"x"``) stays negative."""
    if isinstance(body, dict):
        if path in DEFAULT_LIMIT and not any(key in body for key in LIMIT_KEYS):
            body[DEFAULT_LIMIT[path]] = 4
        for key in LIMIT_KEYS:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 4:
                body[key] = 4
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2
    return body


OPENAPI_FUZZ = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_openapi_fuzz(openapi_schema, served, mode):
    """Every operation of ``/openapi.json``, with bodies the schema allows (positive) or rules out
    (negative), 8 examples each, derandomized. On each response: no 5xx, a documented status code,
    content type and (where documented) response schema; negative bodies are refused."""
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        negative_data_rejection,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    # not ``positive_data_acceptance``: a schema-valid body may still be refused, with a documented
    # 400, for what a schema cannot say (``tool_choice`` naming a tool that ``tools`` lacks; JSON
    # Schema's ``integer`` admits ``5.0``, the codecs take only JSON integers)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    if mode == "negative":
        checks.append(negative_data_rejection)

    operations = [result.ok() for result in openapi_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:

        @OPENAPI_FUZZ
        @given(operation.as_strategy(generation_mode=GenerationMode(mode)))
        def check(case):
            case.body = _bounded(operation.path, case.body)
            case.call_and_validate(base_url=served.base_url, timeout=120, checks=checks)

        try:
            check()
        except Unsatisfiable:  # nothing to negate: a GET without parameters
            assert mode == "negative", operation.label

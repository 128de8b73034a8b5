"""Every way an exchange can end early gives its slot and its KV blocks back, at once.

After each kind of refused, aborted or abandoned request the server must be idle: no request in
flight in the front, ``/metrics`` reporting zero running and waiting requests and no KV blocks in
use, and the abandoned request stopped early (it generated fewer tokens than it asked for: it was
aborted, not run to its end). Requests that cannot end by themselves use ``/v1/completions`` with
``ignore_eos``; the protocol routes share the same exchange code, and each is also closed before
its first event and while it waits in the queue.
"""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import ENGINE_ARGS, MODEL

LONG = 900  # tokens a request asks for: far more than it gets before it is abandoned
BODIES = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": LONG,
    },
    "/v1/responses": {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": LONG},
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": LONG,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    },
    "/v1/completions": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True},
}
ENDLESS = BODIES["/v1/completions"]


def metrics(base_url: str) -> dict[tuple[str, str], float]:
    """(sample name, finished_reason label or "") -> value, read with prometheus_client's parser."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        (s.name, s.labels.get("finished_reason", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def assert_idle(served, before: dict, abandoned: int) -> None:
    """Nothing in flight, nothing running or waiting, every KV block free, and the
    ``abandoned`` requests stopped short of their max_tokens."""
    deadline = time.monotonic() + 120
    while (health := served.health())["in_flight"] or health["running"] or health["waiting"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    after = metrics(served.base_url)
    assert health["kv_usage"] == 0.0, health
    assert after[("deepinfer:num_requests_running", "")] == 0 and after[("deepinfer:num_requests_waiting", "")] == 0, (
        after
    )
    assert after[("deepinfer:kv_cache_usage_perc", "")] == 0.0
    if served.server is not None:  # in-process: the front's own count, not only what /health says
        assert served.server.front.in_flight == 0
    generated = after[("deepinfer:generation_tokens_total", "")] - before[("deepinfer:generation_tokens_total", "")]
    assert not abandoned or generated < abandoned * LONG, (
        f"{abandoned} abandoned requests generated {generated} tokens: not aborted"
    )
    key = ("deepinfer:request_success_total", "abort")
    assert after.get(key, 0) - before.get(key, 0) == abandoned, "every abandoned request is counted as aborted"


@contextlib.contextmanager
def open_stream(base_url: str, path: str, body: dict | None = None):
    """An SSE response whose headers have arrived; closing the block hangs up."""
    with (
        httpx.Client(base_url=base_url, timeout=300) as client,
        client.stream("POST", path, json={**(body or BODIES[path]), "stream": True}) as response,
    ):
        assert response.status_code == 200
        yield response


@pytest.mark.parametrize("path", list(BODIES))
def test_stream_closed_before_its_first_event(served, path):
    before = metrics(served.base_url)
    with open_stream(served.base_url, path):
        pass  # headers only: hang up before any event is read
    assert_idle(served, before, abandoned=1)


@pytest.mark.parametrize("path", list(BODIES))
def test_stream_closed_after_its_first_event(served, path):
    before = metrics(served.base_url)
    with open_stream(served.base_url, path) as response:
        next(response.iter_lines())
    assert_idle(served, before, abandoned=1)


@pytest.mark.parametrize("path", list(BODIES))
def test_stream_closed_while_still_waiting(served, path):
    """The running batch is full of endless requests, so this one waits in the queue when its
    client hangs up; then the batch is abandoned too."""
    before = metrics(served.base_url)
    with contextlib.ExitStack() as batch:
        for _ in range(ENGINE_ARGS["max_num_seqs"]):
            batch.enter_context(open_stream(served.base_url, "/v1/completions", ENDLESS))
        with open_stream(served.base_url, path):
            deadline = time.monotonic() + 120
            while served.health()["waiting"] == 0:  # admitted, and queued behind the batch
                assert time.monotonic() < deadline
                time.sleep(0.05)
    assert_idle(served, before, abandoned=ENGINE_ARGS["max_num_seqs"] + 1)


def test_non_streamed_client_that_hangs_up(served):
    before = metrics(served.base_url)
    with (
        httpx.Client(base_url=served.base_url, timeout=httpx.Timeout(300, read=3)) as client,
        pytest.raises(httpx.ReadTimeout),
    ):
        client.post("/v1/completions", json=ENDLESS)
    assert_idle(served, before, abandoned=1)


def test_refused_by_the_engine(served):
    """Admitted by the front, refused by the engine (a token id outside the vocabulary)."""
    before = metrics(served.base_url)
    response = httpx.post(f"{served.base_url}/v1/completions", json={**ENDLESS, "prompt": [1, 10**9]}, timeout=60)
    assert response.status_code == 400 and "token" in response.json()["error"]["message"], response.text
    assert_idle(served, before, abandoned=0)


def test_finished_requests_leave_nothing(served):
    before = metrics(served.base_url)
    body = {**ENDLESS, "max_tokens": 3}
    assert httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=300).status_code == 200
    with open_stream(served.base_url, "/v1/completions", body) as response:
        assert response.read().decode().rstrip().endswith("data: [DONE]")
    assert_idle(served, before, abandoned=0)


def test_engine_failing_to_add_a_request(served, monkeypatch):
    """An unexpected error while the engine adds a request (not the request's fault) is a 500 in
    the protocol's shape; the step thread lives on and the slot comes back."""
    if served.server is None:
        pytest.skip("needs the in-process server (DEEPINFER_SERVE_TEST_URL is set)")
    engine = served.server.engine
    real_add = engine.add_request

    def add_once(*args, **kwargs):
        monkeypatch.setattr(engine, "add_request", real_add)
        raise RuntimeError("injected: the engine could not add the request")

    monkeypatch.setattr(engine, "add_request", add_once)
    before = metrics(served.base_url)
    response = httpx.post(
        f"{served.base_url}/v1/chat/completions", json={**BODIES["/v1/chat/completions"], "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 500 and "injected" in response.json()["error"]["message"], response.text
    assert_idle(served, before, abandoned=0)
    assert (
        httpx.post(f"{served.base_url}/v1/completions", json={**ENDLESS, "max_tokens": 2}, timeout=300).status_code
        == 200
    )


def test_health_and_metrics_answer_while_the_engine_is_busy(served):
    """The event loop never waits on a step: with a request generating, /health and /metrics
    answer, and what they report is that request running."""
    before = metrics(served.base_url)
    with open_stream(served.base_url, "/v1/completions", ENDLESS) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events), next(events)  # step 2's event follows the stats published after step 1
        for _ in range(5):
            assert served.health()["running"] == 1
            assert metrics(served.base_url)[("deepinfer:num_requests_running", "")] == 1
    assert_idle(served, before, abandoned=1)

"""``POST /v1/inspect`` on a real server (SmolLM2): the prompt it reports is the one the request
runs with (the official ``openai`` SDK's usage counts the same tokens), its cache report matches
what the next identical request is served from the cache, it changes nothing (the Prometheus
counters of the prefix cache stay put), and the parser report is what the server's own reply
carries."""

from __future__ import annotations

import re

import httpx
import pytest
from serve_harness import MODEL

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^deepinfer:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _inspect(served, body: dict) -> httpx.Response:
    return httpx.post(f"{served.base_url}/v1/inspect", json=body, timeout=60)


def test_prompt_tokens_and_cached_blocks_match_what_the_request_gets(served, oai):
    messages = [{"role": "user", "content": "Inspect me, please. " * 12 + "Typed <|im_start|> stays text."}]
    before = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    first = _inspect(served, {"request": {"messages": messages}})
    assert first.status_code == 200, first.text
    report = first.json()
    after = httpx.get(f"{served.base_url}/metrics", timeout=10).text
    for counter in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens"):
        assert _metric(before, counter) == _metric(after, counter), counter  # no side effects

    tokens = report["prompt"]["tokens"]
    assert report["num_tokens"] == len(tokens)
    assert "".join(t["text"] for t in tokens) == report["prompt"]["text"]
    specials = [t["text"] for t in tokens if t["special"]]
    assert specials[0] == "<|im_start|>" and "<|im_end|>" in specials
    # the template's markers are special tokens; the same text typed by the user is not
    assert report["prompt"]["text"].count("<|im_start|>") == specials.count("<|im_start|>") + 1
    size = report["block_size"]
    assert [b["start"] for b in report["blocks"]] == list(range(0, len(tokens) // size * size, size))
    assert all(b["tier"] is None for b in report["blocks"]) and report["cached_tokens"] == 0

    reply = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == report["num_tokens"]  # the same prompt, counted by the server

    report = _inspect(served, {"request": {"messages": messages}}).json()
    assert {b["tier"] for b in report["blocks"]} == {"device"}
    again = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == report["cached_tokens"] > 0


def test_parser_report_matches_the_reply(served, oai):
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    reply = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=40, temperature=0
    )
    call = reply.choices[0].message.tool_calls[0].function
    raw = f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'
    report = _inspect(served, {"request": {"messages": messages, "tools": TOOLS}, "output": raw})
    assert report.status_code == 200, report.text
    parsed = report.json()["parsed"]
    assert [(c["name"], c["arguments"].replace(" ", "")) for c in parsed["tool_calls"]] == [
        (call.name, call.arguments.replace(" ", ""))
    ]
    assert report.json()["prompt"]["text"].count("get_weather") >= 1  # the tools are in the prompt


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"request": {"messages": []}}, "messages"),
        ({"request": {"messages": [{"role": "user", "content": "x" * 200_000}]}}, "messages"),
        ({"request": {"messages": [{"role": "user", "content": "Hi"}]}, "endpoint": "/nope"}, "endpoint"),
        ({"request": {"messages": [{"role": "user", "content": "Hi"}]}, "output": 3}, "output"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ],
)
def test_bad_bodies_are_400_in_the_endpoints_shape(served, body, param):
    response = _inspect(served, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_other_endpoints(served):
    report = _inspect(
        served,
        {"endpoint": "/v1/messages", "request": {"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}},
    )
    assert report.status_code == 200 and report.json()["sampling"]["max_tokens"] == 5
    report = _inspect(served, {"endpoint": "/v1/completions", "request": {"prompt": [5, 6, 7]}})
    assert [t["id"] for t in report.json()["prompt"]["tokens"]] == [5, 6, 7]
    error = _inspect(served, {"endpoint": "/v1/messages", "request": {"messages": [{"role": "user", "content": "Hi"}]}})
    assert error.status_code == 400 and error.json()["type"] == "error"  # Anthropic's error shape

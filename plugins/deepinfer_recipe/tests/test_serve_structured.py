"""Structured output through xgrammar: 20 different JSON schemas (Chat ``json_schema``, Responses
``text.format``), ``json_object``, batched together with unconstrained requests; every
constrained output parses and validates with ``jsonschema``."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest
from serve_harness import MODEL

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]},
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}},
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 2}}, "required": ["tags"]},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
            }
        },
        "required": ["point"],
    },
    {"type": "object", "properties": {"status": {"const": "done"}}, "required": ["status"]},
    {"type": "object", "properties": {"value": {"type": ["integer", "null"]}}, "required": ["value"]},
    {
        "type": "object",
        "properties": {"pick": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
        "required": ["pick"],
    },
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{2,6}$"}}, "required": ["word"]},
    {
        "type": "object",
        "properties": {"first": NAME, "second": NAME, "third": NAME},
        "required": ["first", "second", "third"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {
            "day": {"enum": ["mon", "tue", "wed"]},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        },
        "required": ["day", "hour"],
    },
    {
        "type": "object",
        "properties": {
            "pairs": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
                "maxItems": 2,
            }
        },
        "required": ["pairs"],
    },
    {
        "type": "object",
        "properties": {
            "title": NAME,
            "done": {"type": "boolean"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["title", "done", "score"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def _constrained(oai, i: int) -> tuple[str, dict | None]:
    schema = SCHEMAS[i]
    prompt = f"Reply with JSON matching this schema: {json.dumps(schema)}"
    if i % 2:  # half through the Responses API's text.format
        reply = oai.responses.create(
            model=MODEL,
            input=prompt,
            max_output_tokens=200,
            temperature=0,
            text={"format": {"type": "json_schema", "name": f"s{i}", "schema": schema, "strict": True}},
        )
        return reply.output_text, schema
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=200,
        temperature=0.7,
        seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    return reply.choices[0].message.content, schema


def _free(oai, i: int) -> tuple[str, None]:
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=24,
        temperature=0.7,
        seed=i,
    )
    return reply.choices[0].message.content, None


def test_twenty_schemas_validate_batched_with_free_text(oai):
    jobs = [(_constrained, i) for i in range(len(SCHEMAS))] + [(_free, i) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: job[0](oai, job[1]), jobs))
    for text, schema in results:
        if schema is None:
            assert text.strip() and not text.lstrip().startswith("{")  # unconstrained rows stay free text
            continue
        jsonschema.validate(json.loads(text), schema)


def test_json_object(oai):
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object with the name and age of a person."}],
        max_tokens=150,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_grammar_that_ends_before_min_tokens_is_a_clean_400_and_the_server_goes_on(served, oai):
    """The grammar is complete after a few tokens (only EOS allowed) while ``min_tokens`` bans EOS:
    no token is left. Non-streamed: the protocol's 400 naming the conflict; streamed: an error
    frame after the started stream; a free request meanwhile is unaffected."""
    import httpx

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        "max_tokens": 60,
        "extra_body": {"min_tokens": 50},
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "yes", "schema": SCHEMAS[2]}},
    }
    raw = {**{k: v for k, v in body.items() if k != "extra_body"}, "min_tokens": 50}
    alone = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=16, temperature=0
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        free = pool.submit(
            oai.chat.completions.create,
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me about the sea."}],
            max_tokens=16,
            temperature=0,
        )
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(**body)
        assert free.result().choices[0].message.content == alone.choices[0].message.content
    assert "no token can be sampled" in refused.value.message and "min_tokens" in refused.value.message
    with httpx.stream(
        "POST", f"{served.base_url}/v1/chat/completions", json={**raw, "stream": True}, timeout=120
    ) as reply:
        assert reply.status_code == 200
        frames = [line for line in reply.iter_lines() if line.startswith("data: ")]
    error = json.loads(frames[-1][len("data: ") :])["error"]
    assert error["type"] == "invalid_request_error" and "min_tokens" in error["message"]
    ok = oai.chat.completions.create(**{**body, "extra_body": {"min_tokens": 2}})
    assert json.loads(ok.choices[0].message.content) in ({"ok": True}, {"ok": False})

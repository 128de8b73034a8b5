"""``/openapi.json`` and ``/docs`` of a real server: the schema documents every protocol route's
request body, bodies the official SDKs send validate against it (checked by the independent
``jsonschema`` validator) and are served, bodies it rules out are refused by the server too, and
the docs page loads only local files."""

from __future__ import annotations

import re

import httpx
import jsonschema
import pytest
from serve_harness import MODEL

SCHEMA = "OpenAPI 3.1 (JSON Schema 2020-12)"
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
SERVED = {  # bodies shaped as the SDKs send them, each answered 200
    "/v1/chat/completions": [
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [TOOL],
            "tool_choice": "auto",
            "max_completion_tokens": 4,
            "temperature": 0,
            "stop": ["\n\n"],
            "seed": 3,
        },
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "A number"}],
            "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
        },
    ],
    "/v1/responses": [
        {"model": MODEL, "input": "Hi", "max_output_tokens": 3},
        {
            "model": MODEL,
            "input": [{"role": "user", "content": "Hi"}],
            "instructions": "Be brief.",
            "max_output_tokens": 3,
        },
    ],
    "/v1/messages": [
        {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], "system": "Be brief."},
        {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
    ],
    "/v1/completions": [
        {"model": MODEL, "prompt": "Hi", "max_tokens": 3},
        {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True},
    ],
}
REFUSED = {  # ruled out by the schema and refused (4xx) by the server
    "/v1/chat/completions": [
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "robot", "content": "Hi"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 3},
        {"model": "other-model", "messages": [{"role": "user", "content": "Hi"}]},
    ],
    "/v1/responses": [{"model": MODEL, "input": ""}, {"model": MODEL, "input": "Hi", "max_output_tokens": 0}],
    "/v1/messages": [{"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}],  # max_tokens required
    "/v1/completions": [{"model": MODEL, "prompt": "Hi", "n": 2}, {"model": MODEL, "prompt": "Hi", "stop": [""]}],
}


@pytest.fixture(scope="module")
def spec(served) -> dict:
    response = httpx.get(f"{served.base_url}/openapi.json", timeout=30)
    assert response.status_code == 200
    return response.json()


def _validator(spec: dict, path: str) -> jsonschema.Draft202012Validator:
    body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    # the components are reachable through "#/components/schemas/..." from the document's root
    return jsonschema.Draft202012Validator({**body, "components": spec["components"]})


def test_every_protocol_route_is_documented_with_its_body(spec):
    assert spec["openapi"].startswith("3.1")
    for path in SERVED:
        operation = spec["paths"][path]["post"]
        schema = _validator(spec, path).schema
        assert schema["$ref"].startswith("#/components/schemas/")
        assert {"200", "400", "404", "429"} <= set(operation["responses"])
    for path in ("/v1/models", "/v1/plugins", "/health", "/metrics", "/v1/inspect"):
        assert path in spec["paths"], path
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["model"]["enum"] == [MODEL]  # the one model this server serves
    assert set(chat["required"]) == {"model", "messages"}


@pytest.mark.parametrize("path", sorted(SERVED))
def test_bodies_the_sdks_send_validate_and_are_served(served, spec, path):
    validator = _validator(spec, path)
    for body in SERVED[path]:
        validator.validate(body)
        response = httpx.post(f"{served.base_url}{path}", json=body, timeout=120)
        assert response.status_code == 200, (body, response.text)


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_bodies_the_schema_rules_out_are_refused(served, spec, path):
    validator = _validator(spec, path)
    for body in REFUSED[path]:
        assert not validator.is_valid(body), body
        response = httpx.post(f"{served.base_url}{path}", json=body, timeout=60)
        assert 400 <= response.status_code < 500, (body, response.text)


def test_docs_page_loads_only_local_assets(served):
    page = httpx.get(f"{served.base_url}/docs", timeout=30)
    assert page.status_code == 200 and "swagger" in page.text.lower()
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text) + re.findall(r"url: ?'([^']+)'", page.text)
    assert urls and not [u for u in urls if u.startswith(("http:", "https:", "//"))], urls
    for url in urls:
        if url != "/":
            assert httpx.get(f"{served.base_url}/{url.lstrip('/')}", timeout=30).status_code == 200, url

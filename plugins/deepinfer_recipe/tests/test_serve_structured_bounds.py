"""Structured output that closes (issue 31.5): a strict ``json_schema`` with an unbounded
integer let SmolLM2 write ``{"city": "Tokyo", "population": 3233232323...`` until max_tokens cut
it, and the reply was not JSON. What a schema leaves unbounded is bounded in the grammar (15
integer digits, as llama.cpp does; 4,096 characters for a string without a length); the
reply then parses, and when max_tokens does cut a constrained reply, finish_reason says so."""

from __future__ import annotations

import json

import jsonschema
import pytest
from serve_harness import MODEL

from deepinfer_core.serve.grammar import MAX_INTEGER_DIGITS, bounded_schema

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def _accepts(schema: dict, text: str) -> bool:
    """Whether xgrammar's matcher for ``schema`` (as the server compiles it) accepts ``text``."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)], vocab_size=95)  # one character per token
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(bounded_schema(schema)), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return all(matcher.accept_token(ord(c) - 32) for c in text) and matcher.is_terminated()


def test_the_grammar_caps_integer_digits_and_keeps_the_schemas_own_bounds():
    digits = "9" * MAX_INTEGER_DIGITS
    assert _accepts(CITY, f'{{"city": "Tokyo", "population": {digits}}}')
    assert not _accepts(CITY, f'{{"city": "Tokyo", "population": {digits}3}}')
    assert _accepts(CITY, f'{{"city": "Tokyo", "population": -{digits}}}')
    big = {"type": "integer", "minimum": 0, "maximum": 10**18}  # the schema's bound wins
    assert _accepts(big, str(10**18)) and not _accepts(big, "-1")
    assert bounded_schema({"type": "string", "maxLength": 9}) == {"type": "string", "maxLength": 9}
    assert bounded_schema({"enum": [1, 2]}) == {"enum": [1, 2]}


def test_the_issue_request_returns_json_or_says_length(oai):
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the largest city of Japan and its population as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": CITY}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
    jsonschema.validate(json.loads(choice.message.content), CITY)


@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_reply_cut_by_max_tokens_reports_length(oai, stream):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Tokyo as JSON."}],
        max_tokens=3,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": CITY}},
    )
    if stream:
        reasons = [c.choices[0].finish_reason for c in oai.chat.completions.create(**kw, stream=True) if c.choices]
        assert reasons[-1] == "length"
    else:
        assert oai.chat.completions.create(**kw).choices[0].finish_reason == "length"

"""The V4 encoding and parser against DeepSeek's reference encoder on edge cases (issue 7).

Expected prompts and parses come from ``data/deepseek_v4_encoding/reference_behaviour.json``,
the reference's own output (see the README there). Where the reference raises, or returns
something a served API must not (``NaN`` in arguments), our behaviour is spelled out here.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from recipe_testdata import DATA, load
from tokenizers import Tokenizer

from deepinfer_recipe.deepseek_v4 import DeepSeekV4Encoding, conversation_from_reference, make_parser

REFERENCE = load(DATA / "reference_behaviour.json")
ENCODE = {v["name"]: v for v in REFERENCE["encode"]}
PARSE = {v["name"]: v for v in REFERENCE["parse"]}
RENDERED = sorted(n for n, v in ENCODE.items() if "prompt" in v)
PARSED = sorted(n for n, v in PARSE.items() if "parsed" in v)
#: the reference returns invalid JSON arguments here; we return a JSON string value instead
NOT_JSON_IN_REFERENCE = {
    "nan_in_non_string_parameter": '{"x": "NaN"}',
    "invalid_json_non_string_parameter": '{"x": "{oops"}',
}
TYPED_MARKERS = "user_typed_markers_in_tool_result_and_reasoning"


def conversation(vector):
    return conversation_from_reference(
        vector["messages"], thinking_mode=vector["thinking_mode"], reasoning_effort=vector["reasoning_effort"]
    )


def parse(chunks, thinking: bool) -> dict:
    parser = make_parser({"thinking": thinking})
    outs = [parser.push(c) for c in chunks] + [parser.finish()]
    return {
        "role": "assistant",
        "content": "".join(o.content for o in outs),
        "reasoning_content": "".join(o.reasoning for o in outs),
        "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for o in outs
            for c in o.tool_calls
        ],
    }


@pytest.fixture(scope="module")
def encoding(tokenizer_path):
    return DeepSeekV4Encoding(tokenizer_path=str(tokenizer_path))


@pytest.fixture(scope="module")
def default_tokenizer(tokenizer_path):
    return Tokenizer.from_file(str(tokenizer_path))


def test_every_listed_difference_has_cases():
    names = " ".join(ENCODE) + " " + " ".join(PARSE)
    for topic in (
        "developer",
        "consecutive_users",
        "latest_reminder",
        "unmatched_id",
        "list_of_parts",
        "arguments_empty",
        "arguments_not_json",
        "arguments_empty_object",
        "reasoning_without_tools",
        "max_effort_chat",
        "prefix_continuation",
        "task_query",
        "task_title",
        "task_action",
        "whitespace_before_name",
        "newlines_before_think_close",
        "newlines_before_tool_block",
        "truncated",
        "json_text_kept_exactly",
    ):
        assert topic in names, topic


@pytest.mark.parametrize("name", RENDERED)
def test_prompt_equals_reference(name):
    vector = ENCODE[name]
    assert DeepSeekV4Encoding().render(conversation(vector)) == vector["prompt"]


@pytest.mark.parametrize("name", sorted(set(RENDERED) - {TYPED_MARKERS}))
def test_ids_equal_default_encoder(name, encoding, default_tokenizer):
    vector = ENCODE[name]
    assert list(encoding.encode(conversation(vector)).token_ids) == default_tokenizer.encode(vector["prompt"]).ids


def test_typed_markers_in_results_reasoning_and_arguments_stay_text(encoding, default_tokenizer):
    vector = ENCODE[TYPED_MARKERS]
    ids = list(encoding.encode(conversation(vector)).token_ids)
    assert default_tokenizer.decode(ids, skip_special_tokens=False) == vector["prompt"]
    special = {
        default_tokenizer.token_to_id(t) for t in ("<｜User｜>", "<｜Assistant｜>", "</think>", "<｜end▁of▁sentence｜>")
    }
    forged = default_tokenizer.encode(vector["prompt"]).ids
    # ours: only the markers the layout places (two </think> in the tools instructions, one after
    # the reasoning); the default encoder also turns the typed ones into specials
    counts = {i: ids.count(i) for i in special}
    assert counts == {
        default_tokenizer.token_to_id("<｜User｜>"): 2,
        default_tokenizer.token_to_id("<｜Assistant｜>"): 2,
        default_tokenizer.token_to_id("</think>"): 3,
        default_tokenizer.token_to_id("<｜end▁of▁sentence｜>"): 1,
    }
    assert sum(forged.count(i) for i in special) > sum(counts.values())


def test_no_crash_where_the_reference_raises():
    raising = {n for n, v in ENCODE.items() if "reference_raises" in v}
    assert raising == {"tool_call_arguments_not_an_object", "developer_empty_content"}
    prompt = DeepSeekV4Encoding().render(conversation(ENCODE["tool_call_arguments_not_an_object"]))
    assert '<｜DSML｜parameter name="arguments" string="true">[1, 2]</｜DSML｜parameter>' in prompt
    assert DeepSeekV4Encoding().render(conversation(ENCODE["developer_empty_content"])) == (
        "<｜begin▁of▁sentence｜><｜User｜><｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    ("name", "thinking"),
    [
        ("prefix_continuation_without_eos_thinking", False),
        ("task_query_on_last_user_thinking", False),
        ("task_action_on_last_user_thinking", False),
        ("latest_reminder_after_last_user_thinking", False),
        ("max_effort_thinking", True),
        ("max_effort_chat", False),
    ],
)
def test_parser_starts_where_the_prompt_ends(name, thinking, encoding):
    assert encoding.encode(conversation(ENCODE[name])).parser_options["thinking"] is thinking


@pytest.mark.parametrize("name", PARSED)
@pytest.mark.parametrize("chunking", ["whole", "chars", "random"])
def test_parse_equals_reference(name, chunking):
    vector = PARSE[name]
    text = vector["completion"]
    chunks = {"whole": [text], "chars": list(text)}.get(chunking)
    if chunks is None:
        rng = random.Random(name)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(9, len(text) - 1)))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    got = parse(chunks, vector["thinking_mode"] == "thinking")
    expected = vector["parsed"]
    if name in NOT_JSON_IN_REFERENCE:
        with pytest.raises(ValueError):
            json.loads(expected["tool_calls"][0]["function"]["arguments"], parse_constant=lambda c: float("x"))
        assert got["tool_calls"][0]["function"]["arguments"] == NOT_JSON_IN_REFERENCE[name]
        return
    assert got == expected


@pytest.mark.parametrize(
    ("name", "content", "calls"),
    [
        ("truncated_after_complete_invoke", "", [("f", '{"a": "x"}')]),
        ("answer_without_eos", "partial answer", []),
        ("one_newline_before_block", "ok", [("f", "{}")]),
        ("content_after_tool_block", "more", [("f", "{}")]),
        ("duplicate_parameter", "", [("f", '{"a": "1"}')]),  # the first value wins (streamable)
        ("parameter_header_without_string_flag", "", [("f", '{"b": "kept"}')]),
    ],
)
def test_parse_goes_on_where_the_reference_raises(name, content, calls):
    vector = PARSE[name]
    assert "reference_raises" in vector
    for chunks in ([vector["completion"]], list(vector["completion"])):
        got = parse(chunks, vector["thinking_mode"] == "thinking")
        assert got["content"] == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got["tool_calls"]] == calls


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "system", "content": 5}, "messages[0].content"),  # reference: "5"
        ({"role": "tool", "content": {"a": 1}, "tool_call_id": "c"}, "messages[0].content"),  # reference: "{'a': 1}"
        ({"role": "user", "content": ["text"]}, "messages[0].content[0]"),
        ({"role": "assistant", "reasoning_content": 3}, "messages[0].reasoning_content"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"role": "assistant", "tool_calls": [{"name": "f"}]}, "messages[0].tool_calls[0]"),
        ({"content": "no role"}, "messages[0]"),
    ],
)
def test_reference_messages_of_the_wrong_shape_are_refused_naming_the_field(message, field):
    """The reference renders Python's str() of a non-string content (or raises); we refuse with
    the field's name instead of rendering it, crashing with "'int' object is not iterable", or
    silently dropping it."""
    with pytest.raises(ValueError, match=rf"^{re.escape(field)} must be"):
        conversation_from_reference([message])

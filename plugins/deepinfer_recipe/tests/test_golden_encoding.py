"""The V4 encoding against DeepSeek's reference encoder output (golden vectors) and against the
default ``tokenizers`` encoder of the real tokenizer.json."""

from __future__ import annotations

import pytest
from recipe_testdata import GOLDEN
from tokenizers import Tokenizer

from deepinfer_recipe.deepseek_v4 import DeepSeekV4Encoding, conversation_from_reference
from deepinfer_recipe.openai_chat import OpenAIChatCodec

pytestmark = pytest.mark.golden
ENCODE = {v["name"]: v for v in GOLDEN["encode"]}
INJECTION = "user_text_with_marker_strings"


def conversation(vector):
    return conversation_from_reference(
        vector["messages"], thinking_mode=vector["thinking_mode"], reasoning_effort=vector["reasoning_effort"]
    )


@pytest.fixture(scope="module")
def encoding(tokenizer_path):
    return DeepSeekV4Encoding(tokenizer_path=str(tokenizer_path))


@pytest.fixture(scope="module")
def default_tokenizer(tokenizer_path):
    return Tokenizer.from_file(str(tokenizer_path))


def test_all_twelve_vectors_present():
    assert len(ENCODE) == 12


@pytest.mark.parametrize("name", sorted(ENCODE))
def test_prompt_matches_reference_byte_for_byte(name):
    vector = ENCODE[name]
    assert DeepSeekV4Encoding().render(conversation(vector)) == vector["prompt"]


@pytest.mark.parametrize("name", sorted(set(ENCODE) - {INJECTION}))
def test_ids_equal_default_encoder_on_normal_prompts(name, encoding, default_tokenizer):
    vector = ENCODE[name]
    expected = default_tokenizer.encode(vector["prompt"]).ids
    assert list(encoding.encode(conversation(vector)).token_ids) == expected


@pytest.mark.parametrize("name", sorted(ENCODE))
def test_ids_decode_back_to_the_prompt(name, encoding, default_tokenizer):
    vector = ENCODE[name]
    ids = encoding.encode(conversation(vector)).token_ids
    assert default_tokenizer.decode(list(ids), skip_special_tokens=False) == vector["prompt"]


def test_user_typed_markers_stay_plain_text(encoding, default_tokenizer):
    vector = ENCODE[INJECTION]
    ids = list(encoding.encode(conversation(vector)).token_ids)
    user, think_close, dsml = (default_tokenizer.token_to_id(t) for t in ("<｜User｜>", "</think>", "｜DSML｜"))
    # the default encoder turns the typed markers into specials; ours keeps one real <｜User｜>
    # (the turn) and the final </think> (generation prompt), nothing from the user's text
    forged = default_tokenizer.encode(vector["prompt"]).ids
    assert forged.count(user) == 2 and forged.count(dsml) == 1
    assert ids.count(user) == 1 and ids.count(think_close) == 1 and dsml not in ids
    assert ids[-1] == think_close
    assert default_tokenizer.decode(ids, skip_special_tokens=False) == vector["prompt"]


def test_stop_ids_and_parser_options(encoding, default_tokenizer):
    encoded = encoding.encode(conversation(ENCODE["chat_single_turn"]))
    assert encoded.stop_token_ids == (default_tokenizer.token_to_id("<｜end▁of▁sentence｜>"),)
    assert encoded.token_ids[0] == default_tokenizer.token_to_id("<｜begin▁of▁sentence｜>")
    assert encoded.parser_options["thinking"] is False
    assert encoding.encode(conversation(ENCODE["thinking_max_effort"])).parser_options["thinking"] is True


def _openai_body(vector) -> dict | None:
    """The vector as a standard Chat Completions request (tools lifted from the first system
    message to the request), or None when it uses DeepSeek-only message fields."""
    messages = [dict(m) for m in vector["messages"]]
    body: dict = {"model": "deepseek-v4"}
    if messages and "tools" in messages[0] and messages[0]["role"] == "system":
        body["tools"] = messages[0].pop("tools")
    if messages and "response_format" in messages[0]:
        body["response_format"] = messages[0].pop("response_format")
    if any(
        m["role"] not in ("system", "user", "assistant", "tool")
        or set(m) - {"role", "content", "reasoning_content", "tool_calls", "tool_call_id"}
        for m in messages
    ):
        return None
    body["messages"] = messages
    body["thinking"] = {"type": "enabled" if vector["thinking_mode"] == "thinking" else "disabled"}
    if vector["reasoning_effort"]:
        body["reasoning_effort"] = vector["reasoning_effort"]
    return body


OPENAI_EXPRESSIBLE = sorted(name for name, v in ENCODE.items() if _openai_body(v) is not None)


def test_most_vectors_are_expressible_through_openai():
    assert len(OPENAI_EXPRESSIBLE) >= 9


@pytest.mark.parametrize("name", OPENAI_EXPRESSIBLE)
def test_prompt_through_openai_codec(name):
    vector = ENCODE[name]
    request = OpenAIChatCodec().parse_request(_openai_body(vector))
    assert DeepSeekV4Encoding().render(request) == vector["prompt"]

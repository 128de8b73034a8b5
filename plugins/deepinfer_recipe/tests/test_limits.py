"""Request limits and JSON hygiene (issue 7): deep nesting, lone surrogates and non-finite numbers
are refused with a 400 naming the place and the limit, in every codec; NaN written by the model
never reaches a JSON reply."""

from __future__ import annotations

import json

import pytest

from deepinfer_core.codecs import ParsedOutput, ProtocolError
from deepinfer_recipe.anthropic_messages import AnthropicMessagesCodec
from deepinfer_recipe.deepseek_v4 import DeepSeekV4Encoding, make_parser
from deepinfer_recipe.json_limits import LIMITS
from deepinfer_recipe.openai_chat import OpenAIChatCodec
from deepinfer_recipe.openai_responses import OpenAIResponsesCodec

DEPTH = 5000  # far past the limit and past Python's recursion limit


def nested(depth: int = DEPTH) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def anthropic(**extra):
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **extra}


def responses(**extra):
    return {"model": "m", "input": "hi", **extra}


CODECS = {
    "chat": (OpenAIChatCodec, chat),
    "anthropic": (AnthropicMessagesCodec, anthropic),
    "responses": (OpenAIResponsesCodec, responses),
}
SCHEMA_TOOLS = {
    "chat": lambda schema: [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    "anthropic": lambda schema: [{"name": "f", "input_schema": schema}],
    "responses": lambda schema: [{"type": "function", "name": "f", "parameters": schema}],
}


def refused(codec, body) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        codec.parse_request(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("name", sorted(CODECS))
def test_deep_tool_schema_is_a_400_naming_the_limit(name):
    codec_type, body = CODECS[name]
    error = refused(codec_type(), body(tools=SCHEMA_TOOLS[name](nested())))
    assert f"{LIMITS.max_depth} levels (limit)" in error.message and error.param.startswith("tools[0]")


def test_deep_anthropic_tool_use_input():
    body = anthropic(
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": nested()}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
        ]
    )
    error = refused(AnthropicMessagesCodec(), body)
    assert error.param.startswith("messages[1].content[0].input") and "levels (limit)" in error.message


@pytest.mark.parametrize(
    "arguments", ["[" * DEPTH + "]" * DEPTH, '{"a": ' * DEPTH + "1" + "}" * DEPTH, '{"a": ' * 200 + "1" + "}" * 200]
)
def test_deep_tool_call_arguments_text(arguments):
    body = chat(
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}],
            },
        ]
    )
    error = refused(OpenAIChatCodec(), body)
    assert error.param.startswith("messages[1].tool_calls[0].function.arguments") and "levels (limit)" in error.message
    body = responses(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments}])
    assert "levels (limit)" in refused(OpenAIResponsesCodec(), body).message


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("text", ["a\ud800b", "\udfff", "x" * 3 + "\udc80"])
def test_lone_surrogates_are_refused(name, text):
    codec_type, body = CODECS[name]
    raw = body()
    if name == "responses":
        raw["input"] = text
    else:
        raw["messages"] = [{"role": "user", "content": text}]
    error = refused(codec_type(), raw)
    assert "surrogate" in error.message
    assert error.param == ("input" if name == "responses" else "messages[0].content")


def test_escaped_surrogate_inside_arguments_json_is_refused():
    body = chat(
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"q": "\\ud800"}'}}
                ],
            },
        ]
    )
    assert "surrogate" in refused(OpenAIChatCodec(), body).message


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_refused_anywhere(name, number):
    codec_type, body = CODECS[name]
    error = refused(codec_type(), body(tools=SCHEMA_TOOLS[name]({"type": "number", "default": number})))
    assert error.param.endswith("default") and "finite" in error.message
    error = refused(codec_type(), body(temperature=number))
    assert error.param == "temperature"


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("value", [b"bytes", {1, 2}, object(), (1, 2)])
def test_values_json_cannot_carry_are_refused(name, value):
    codec_type, body = CODECS[name]
    error = refused(codec_type(), body(metadata={"k": value}))
    assert error.param == "metadata.k" and "JSON value" in error.message


def test_non_string_keys_are_refused():
    assert "keys must be strings" in refused(OpenAIChatCodec(), chat(metadata={1: "x"})).message


def test_limits_hold_for_wide_bodies_without_recursion():
    # one wide, shallow body is fine: the walk is iterative and counts values
    ok = chat(
        tools=[
            {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(2000)
        ]
    )
    assert len(OpenAIChatCodec().parse_request(ok).tools) == 2000


NAN_OUTPUT = (
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
    '<｜DSML｜parameter name="x" string="false">NaN</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="y" string="false">-Infinity</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_nan_in_model_output_never_reaches_a_json_body(name):
    codec_type, body = CODECS[name]
    codec = codec_type()
    request = codec.parse_request(body())
    parser = make_parser({"thinking": False})
    result = parser.push(NAN_OUTPUT)
    assert json.loads(result.tool_calls[0].arguments) == {"x": "NaN", "y": "-Infinity"}
    reply = codec.render(request, result, {"prompt_tokens": 1, "completion_tokens": 1}, "stop")
    json.dumps(reply, allow_nan=False)
    frames = "".join(codec.stream(request, [result, ParsedOutput(finish_reason="stop", usage={})]))
    data = [line[6:] for line in frames.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert data and all(json.loads(d, parse_constant=_no_constant) for d in data)


def _no_constant(name):
    raise AssertionError(f"{name} in a JSON frame")


def test_encoding_renders_every_accepted_deep_value():
    """The deepest value a codec accepts still renders (no RecursionError later)."""
    request = OpenAIChatCodec().parse_request(chat(tools=SCHEMA_TOOLS["chat"](nested(LIMITS.max_depth - 5))))
    assert DeepSeekV4Encoding().render(request).count('{"a": ') == LIMITS.max_depth - 5


def test_stop_sequences_are_bounded():
    error = refused(AnthropicMessagesCodec(), anthropic(stop_sequences=[f"s{i}" for i in range(17)]))
    assert error.param == "stop_sequences" and "16 stop sequences (limit)" in error.message
    error = refused(OpenAIChatCodec(), chat(stop=["ok", "x" * 1001]))
    assert error.param == "stop[1]" and "1000 characters (limit)" in error.message
    assert refused(OpenAIChatCodec(), chat(stop="x" * 1001)).param == "stop"
    assert OpenAIChatCodec().parse_request(chat(stop=["x" * 1000])).stop == ("x" * 1000,)


def test_encoding_refuses_lone_surrogates_with_a_clear_value_error(tokenizer_path):
    """Conversations built without a codec (LLM.chat, offline tools) get a ValueError, not the
    tokenizer's TypeError."""
    from deepinfer_core.codecs import ConversationRequest, Message

    encoding = DeepSeekV4Encoding(tokenizer_path=str(tokenizer_path))
    with pytest.raises(ValueError, match="lone surrogate"):
        encoding.encode(ConversationRequest(messages=(Message(role="user", content="hi \ud83d"),)))

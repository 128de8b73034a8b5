"""Anthropic Messages codec, checked against the anthropic SDK's pydantic types and its own
stream accumulator, and end to end against golden prompts."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from recipe_testdata import GOLDEN
from sse_frames import parse_frames

from deepinfer_core.codecs import ParsedOutput, ProtocolError, ToolCall
from deepinfer_core.testing.codecs import ProtocolCodecSuite
from deepinfer_recipe.anthropic_messages import AnthropicMessagesCodec
from deepinfer_recipe.deepseek_v4 import DeepSeekV4Encoding

MINIMAL = {"model": "deepseek-v4", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
LOOKUP = {
    "name": "lookup",
    "description": "Look up a fact.",
    "input_schema": {
        "type": "object",
        "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["q"],
    },
}
EVENT = TypeAdapter(RawMessageStreamEvent)


class TestAnthropicMessagesConformance(ProtocolCodecSuite):
    @pytest.fixture
    def codec(self):
        return AnthropicMessagesCodec()

    @pytest.fixture
    def minimal_body(self):
        return dict(MINIMAL)

    @pytest.fixture
    def invalid_bodies(self, minimal_body):
        return [
            {},
            {k: v for k, v in minimal_body.items() if k != "max_tokens"},
            {k: v for k, v in minimal_body.items() if k != "model"},
            {**minimal_body, "messages": []},
            {**minimal_body, "messages": [{"role": "system", "content": "x"}]},
            {**minimal_body, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            {**minimal_body, "temperature": 1.5},
            {**minimal_body, "temperature": -1},
            {**minimal_body, "top_p": 2},
            {**minimal_body, "max_tokens": 0},
            {**minimal_body, "thinking": {"type": "enabled", "budget_tokens": 100}},
            {**minimal_body, "thinking": {"type": "enabled", "budget_tokens": 2048}},  # >= max_tokens
            {**minimal_body, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            {**minimal_body, "tools": [{"name": "f"}]},  # no input_schema
            {**minimal_body, "output_config": {"effort": "ultra"}},
            {**minimal_body, "stop_sequences": "END"},
            {**minimal_body, "thinking": {}},
            {**minimal_body, "tool_choice": {}},
            {**minimal_body, "tool_choice": {"type": "tool"}},  # no name
            {**minimal_body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
        ]


@pytest.fixture
def codec():
    return AnthropicMessagesCodec()


def test_errors_name_the_parameter_and_validate(codec):
    with pytest.raises(ProtocolError) as info:
        codec.parse_request({**MINIMAL, "temperature": 1.2})
    assert info.value.param == "temperature"
    status, body = codec.render_error(info.value)
    error = ErrorResponse.model_validate({**body, "request_id": None})
    assert status == 400 and error.error.type == "invalid_request_error" and "temperature" in error.error.message
    for status, kind in (
        (401, "authentication_error"),
        (429, "rate_limit_error"),
        (529, "overloaded_error"),
        (503, "api_error"),
    ):
        assert codec.render_error(ProtocolError("x", status=status))[1]["error"]["type"] == kind


def test_blocks_map_onto_the_conversation(codec):
    request = codec.parse_request(
        {
            **MINIMAL,
            "system": [{"type": "text", "text": "You help."}],
            "tools": [LOOKUP],
            "tool_choice": {"type": "tool", "name": "lookup"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "max_tokens": 4096,
            "output_config": {"effort": "max"},
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                        {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
    )
    roles = [m.role for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assistant, tool = request.messages[2], request.messages[3]
    assert assistant.reasoning == "hmm" and assistant.tool_calls == (ToolCall("lookup", '{"q": "x"}', "t1"),)
    assert (tool.tool_call_id, tool.content) == ("t1", "42")
    assert request.tools[0]["function"]["parameters"] == LOOKUP["input_schema"]
    assert request.tool_choice == {"type": "function", "function": {"name": "lookup"}}
    assert request.thinking is True and request.reasoning_effort == "max"


GOLDEN_AS_ANTHROPIC = {
    "chat_tools_call_and_result": {
        "system": "You help.",
        "thinking": {"type": "disabled"},
        "tools": [LOOKUP],
        "messages": [
            {"role": "user", "content": "Find the height of Everest, 2 results."},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "c1", "name": "lookup", "input": {"q": "Everest height", "n": 2}}
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "8849 m"}]},
        ],
    },
    "thinking_two_parallel_calls_results_reordered": {
        "tools": [LOOKUP],
        "messages": [
            {"role": "user", "content": "Look up A and B."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two lookups.", "signature": ""},
                    {"type": "tool_use", "id": "a", "name": "lookup", "input": {"q": "A"}},
                    {"type": "tool_use", "id": "b", "name": "lookup", "input": {"q": "B"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "b", "content": "result B"},
                    {"type": "tool_result", "tool_use_id": "a", "content": "result A"},
                ],
            },
        ],
    },
}


@pytest.mark.golden
@pytest.mark.parametrize("name", sorted(GOLDEN_AS_ANTHROPIC))
def test_golden_prompt_through_anthropic_codec(codec, name):
    expected = next(v["prompt"] for v in GOLDEN["encode"] if v["name"] == name)
    request = codec.parse_request({"model": "m", "max_tokens": 100, **GOLDEN_AS_ANTHROPIC[name]})
    assert DeepSeekV4Encoding().render(request) == expected


def test_render_is_a_valid_message(codec):
    request = codec.parse_request({**MINIMAL, "tools": [LOOKUP]})
    result = ParsedOutput(
        content="Let me check.", reasoning="Need data.", tool_calls=(ToolCall("lookup", '{"q": "北京"}'),)
    )
    body = codec.render(request, result, {"prompt_tokens": 20, "completion_tokens": 7, "cached_tokens": 16}, "stop")
    message = Message.model_validate(body)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "Need data." and message.content[1].text == "Let me check."
    assert message.content[2].input == {"q": "北京"} and message.content[2].id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (
        4,
        16,
        7,
    )


@pytest.mark.parametrize(
    ("reason", "expected"), [("stop", "end_turn"), ("length", "max_tokens"), ("stop_sequence", "stop_sequence")]
)
def test_stop_reason_mapping(codec, reason, expected):
    body = codec.render(codec.parse_request(MINIMAL), ParsedOutput(content="x"), {}, reason)
    assert Message.model_validate(body).stop_reason == expected


def test_stream_events_validate_and_accumulate(codec):
    request = codec.parse_request({**MINIMAL, "stream": True, "tools": [LOOKUP]})
    events = [
        ParsedOutput(reasoning="Need ", usage={"prompt_tokens": 11, "completion_tokens": 0}),
        ParsedOutput(reasoning="data."),
        ParsedOutput(content="Checking"),
        ParsedOutput(content="…"),
        ParsedOutput(tool_calls=(ToolCall("lookup", '{"q": "x", "n": 2}'),)),
        ParsedOutput(finish_reason="stop", usage={"prompt_tokens": 11, "completion_tokens": 30}),
    ]
    frames = parse_frames(list(codec.stream(request, events)))
    assert all(name == data["type"] for name, data in frames), "event name must equal the data's type"
    names = [name for name, _ in frames]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    snapshot = None
    json_bufs: dict = {}
    for _, data in frames:
        snapshot = accumulate_event(event=EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=json_bufs)
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use"]
    assert snapshot.content[0].thinking == "Need data." and snapshot.content[1].text == "Checking…"
    assert snapshot.content[2].input == {"q": "x", "n": 2}
    assert (
        snapshot.stop_reason == "tool_use" and snapshot.usage.input_tokens == 11 and snapshot.usage.output_tokens == 30
    )
    indexes = [d["index"] for n, d in frames if n == "content_block_start"]
    assert indexes == [0, 1, 2]


def test_a_tool_use_streamed_piece_by_piece_validates_and_one_cut_short_is_closed(codec):
    from deepinfer_core.codecs import ToolCallDelta

    request = codec.parse_request({**MINIMAL, "stream": True, "tools": [LOOKUP]})
    events = [
        ParsedOutput(content="Check.", usage={"prompt_tokens": 11, "completion_tokens": 0}),
        ParsedOutput(
            tool_call_deltas=(ToolCallDelta("call_1", name="lookup"), ToolCallDelta("call_1", arguments='{"q"'))
        ),
        ParsedOutput(
            tool_call_deltas=(ToolCallDelta("call_1", arguments=': "x"}'),),
            tool_calls=(ToolCall("lookup", '{"q": "x"}', "call_1"),),
            content="Then.",
        ),
        ParsedOutput(
            tool_call_deltas=(ToolCallDelta("call_2", name="lookup"), ToolCallDelta("call_2", arguments='{"q": "y'))
        ),
        ParsedOutput(finish_reason="length", usage={"prompt_tokens": 11, "completion_tokens": 30}),
    ]
    frames = parse_frames(list(codec.stream(request, events)))
    snapshot, json_bufs = None, {}
    for _, data in frames:
        snapshot = accumulate_event(event=EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=json_bufs)
    assert [b.type for b in snapshot.content] == ["text", "tool_use", "text", "tool_use"]
    assert (
        snapshot.content[1].input == {"q": "x"}
        and snapshot.content[1].id == "call_1"
        and snapshot.content[2].text == "Then."
    )
    assert snapshot.stop_reason == "max_tokens"
    starts = [n for n, _ in frames].count("content_block_start")
    assert starts == [n for n, _ in frames].count("content_block_stop") == 4
    assert [
        d["delta"]["partial_json"]
        for n, d in frames
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    ] == ['{"q"', ': "x"}', '{"q": "y']


def test_stream_error_frame(codec):
    ((name, data),) = parse_frames([codec.error_frame(ProtocolError("overloaded", status=529))])
    assert name == "error" and data["error"] == {"type": "overloaded_error", "message": "overloaded"}
    assert json.dumps(data)

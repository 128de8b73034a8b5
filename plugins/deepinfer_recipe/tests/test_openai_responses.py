"""OpenAI Responses codec, checked against the openai SDK's Response / stream event types and
its ResponseStreamState accumulator."""

from __future__ import annotations

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from recipe_testdata import GOLDEN
from sse_frames import parse_frames

from deepinfer_core.codecs import ParsedOutput, ProtocolError, ToolCall
from deepinfer_core.testing.codecs import ProtocolCodecSuite
from deepinfer_recipe.deepseek_v4 import DeepSeekV4Encoding
from deepinfer_recipe.openai_responses import OpenAIResponsesCodec

MINIMAL = {"model": "deepseek-v4", "input": "hi"}
LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Look up a fact.",
    "parameters": {
        "type": "object",
        "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["q"],
    },
}
EVENT = TypeAdapter(ResponseStreamEvent)


class TestOpenAIResponsesConformance(ProtocolCodecSuite):
    @pytest.fixture
    def codec(self):
        return OpenAIResponsesCodec()

    @pytest.fixture
    def minimal_body(self):
        return dict(MINIMAL)

    @pytest.fixture
    def invalid_bodies(self, minimal_body):
        return [
            {},
            {"input": "hi"},
            {**minimal_body, "input": []},
            {**minimal_body, "input": [{"role": "wizard", "content": "x"}]},
            {**minimal_body, "input": [{"type": "web_search_call"}]},
            {**minimal_body, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            {**minimal_body, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},  # no call_id
            {**minimal_body, "temperature": 2.1},
            {**minimal_body, "max_output_tokens": 0},
            {**minimal_body, "reasoning": {"effort": "ultra"}},
            {**minimal_body, "previous_response_id": "resp_1"},
            {**minimal_body, "tools": [{"type": "web_search"}]},
        ]


@pytest.fixture
def codec():
    return OpenAIResponsesCodec()


@pytest.mark.golden
def test_golden_prompt_through_responses_codec(codec):
    vector = next(v for v in GOLDEN["encode"] if v["name"] == "thinking_two_parallel_calls_results_reordered")
    request = codec.parse_request(
        {
            "model": "m",
            "tools": [LOOKUP],
            "input": [
                {"role": "user", "content": "Look up A and B."},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Two lookups."}],
                },
                {"type": "function_call", "call_id": "a", "name": "lookup", "arguments": '{"q": "A"}'},
                {"type": "function_call", "call_id": "b", "name": "lookup", "arguments": '{"q": "B"}'},
                {"type": "function_call_output", "call_id": "b", "output": "result B"},
                {"type": "function_call_output", "call_id": "a", "output": "result A"},
            ],
        }
    )
    assert DeepSeekV4Encoding().render(request) == vector["prompt"]


def test_effort_and_format(codec):
    request = codec.parse_request(
        {
            **MINIMAL,
            "instructions": "Be brief.",
            "reasoning": {"effort": "xhigh"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        }
    )
    assert request.messages[0].role == "system" and request.reasoning_effort == "high"
    assert request.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }
    assert codec.parse_request({**MINIMAL, "reasoning": {"effort": "none"}}).thinking is False


def test_render_is_a_valid_response(codec):
    request = codec.parse_request({**MINIMAL, "tools": [LOOKUP]})
    result = ParsedOutput(content="Checking.", reasoning="Need it.", tool_calls=(ToolCall("lookup", '{"q": "x"}'),))
    response = Response.model_validate(
        codec.render(request, result, {"prompt_tokens": 9, "completion_tokens": 4}, "stop")
    )
    assert response.status == "completed" and response.output_text == "Checking."
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[0].content[0].text == "Need it."
    assert (response.output[2].name, response.output[2].arguments) == ("lookup", '{"q": "x"}')
    assert response.usage.total_tokens == 13 and response.tools[0].name == "lookup"


def test_length_is_incomplete(codec):
    response = Response.model_validate(
        codec.render(codec.parse_request(MINIMAL), ParsedOutput(content="x"), {}, "length")
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_stream_events_validate_and_accumulate(codec):
    request = codec.parse_request({**MINIMAL, "stream": True, "tools": [LOOKUP]})
    events = [
        ParsedOutput(reasoning="Need "),
        ParsedOutput(reasoning="it."),
        ParsedOutput(content="Check"),
        ParsedOutput(content="ing."),
        ParsedOutput(tool_calls=(ToolCall("lookup", '{"q": "x"}'),)),
        ParsedOutput(finish_reason="stop", usage={"prompt_tokens": 9, "completion_tokens": 4}),
    ]
    frames = parse_frames(list(codec.stream(request, events)))
    assert all(name == data["type"] for name, data in frames)
    assert [data["sequence_number"] for _, data in frames] == list(range(len(frames)))
    state = ResponseStreamState(input_tools=[LOOKUP], text_format=omit)
    final = None
    for _, data in frames:
        for out in state.handle_event(EVENT.validate_python(data)):
            if out.type == "response.completed":
                final = out.response  # the SDK's own accumulated, parsed response
    assert final is not None and final.output_text == "Checking." and final.usage.output_tokens == 4
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]


def test_errors(codec):
    with pytest.raises(ProtocolError) as info:
        codec.parse_request({**MINIMAL, "max_output_tokens": 0})
    status, body = codec.render_error(info.value)
    assert status == 400 and body["error"]["param"] == "max_output_tokens"
    ((name, data),) = parse_frames([codec.error_frame(ProtocolError("late", status=500))])
    assert name == "error" and EVENT.validate_python(data).message == "late"


def test_a_call_streamed_piece_by_piece_validates_and_one_cut_short_is_closed(codec):
    """Tool calls streamed as ToolCallDelta pieces: the SDK's own accumulator gets the whole
    call, content after it stays after it, and a call the output limit cut is still closed."""
    from deepinfer_core.codecs import ToolCallDelta

    request = codec.parse_request({**MINIMAL, "stream": True, "tools": [LOOKUP]})
    events = [
        ParsedOutput(content="Check."),
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
        ParsedOutput(finish_reason="length", usage={"prompt_tokens": 9, "completion_tokens": 4}),
    ]
    frames = parse_frames(list(codec.stream(request, events)))
    assert [data["sequence_number"] for _, data in frames] == list(range(len(frames)))
    state = ResponseStreamState(input_tools=[LOOKUP], text_format=omit)
    final = None
    for _, data in frames:
        for out in state.handle_event(EVENT.validate_python(data)):
            if out.type in ("response.completed", "response.incomplete"):
                final = out.response
    assert [item.type for item in final.output] == ["message", "function_call", "message", "function_call"]
    assert [(i.call_id, i.arguments) for i in final.output if i.type == "function_call"] == [
        ("call_1", '{"q": "x"}'),
        ("call_2", '{"q": "y'),
    ]
    deltas = [d["delta"] for _, d in frames if d["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"q"', ': "x"}', '{"q": "y']

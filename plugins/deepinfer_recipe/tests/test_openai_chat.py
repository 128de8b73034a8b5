"""OpenAI Chat Completions codec, checked against the openai SDK's own pydantic types and its
stream accumulator."""

from __future__ import annotations

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject
from sse_frames import parse_frames

from deepinfer_core.codecs import ParsedOutput, ProtocolError, ToolCall
from deepinfer_core.testing.codecs import ProtocolCodecSuite
from deepinfer_recipe.openai_chat import OpenAIChatCodec

MINIMAL = {"model": "deepseek-v4", "messages": [{"role": "user", "content": "hi"}]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    }
]


class TestOpenAIChatConformance(ProtocolCodecSuite):
    @pytest.fixture
    def codec(self):
        return OpenAIChatCodec()

    @pytest.fixture
    def minimal_body(self):
        return dict(MINIMAL)

    @pytest.fixture
    def invalid_bodies(self, minimal_body):
        user = minimal_body["messages"]
        return [
            {},
            {"messages": user},  # no model
            {**minimal_body, "messages": []},
            {**minimal_body, "messages": [{"role": "wizard", "content": "x"}]},
            {**minimal_body, "messages": [{"role": "user"}]},
            {**minimal_body, "messages": [{"role": "tool", "content": "r"}]},  # no tool_call_id
            {
                **minimal_body,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            {**minimal_body, "temperature": 2.5},
            {**minimal_body, "temperature": -0.1},
            {**minimal_body, "temperature": True},
            {**minimal_body, "top_p": 1.5},
            {**minimal_body, "max_tokens": 0},
            {**minimal_body, "max_completion_tokens": -3},
            {**minimal_body, "n": 2},
            {**minimal_body, "stop": ["a", "b", "c", "d", "e"]},
            {**minimal_body, "reasoning_effort": "ultra"},
            {**minimal_body, "tools": [{"type": "function", "function": {}}]},
            {**minimal_body, "response_format": {"type": "yaml"}},
            {**minimal_body, "thinking": {}},
            {**minimal_body, "thinking": {"type": "sometimes"}},
            {
                **minimal_body,
                "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
            },
            {
                **minimal_body,
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}],
                    }
                ],
            },
            {
                **minimal_body,
                "messages": [{"role": "assistant", "content": "a", "prefix": True}, {"role": "user", "content": "x"}],
            },
        ]


@pytest.fixture
def codec():
    return OpenAIChatCodec()


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": None}, "messages"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, "messages[1].role"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
    ],
)
def test_errors_name_the_parameter(codec, patch, param):
    with pytest.raises(ProtocolError) as info:
        codec.parse_request({**MINIMAL, **patch})
    assert info.value.param == param and info.value.status == 400
    status, body = codec.render_error(info.value)
    error = ErrorObject.model_validate(body["error"])
    assert status == 400 and error.param == param and error.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("effort", "thinking", "level"),
    [
        ("minimal", None, "low"),
        ("low", None, "low"),
        ("medium", None, "high"),
        ("xhigh", None, "high"),
        ("max", None, "max"),
        ("none", False, None),
    ],
)
def test_reasoning_effort_mapping(codec, effort, thinking, level):
    request = codec.parse_request({**MINIMAL, "reasoning_effort": effort})
    assert (request.thinking, request.reasoning_effort) == (thinking, level)


def test_thinking_switch_and_sampling_fields(codec):
    request = codec.parse_request(
        {
            **MINIMAL,
            "thinking": {"type": "disabled"},
            "temperature": 0.7,
            "top_p": 0.9,
            "max_completion_tokens": 64,
            "stop": "END",
            "seed": 5,
            "tools": TOOLS,
            "tool_choice": "auto",
            "stream": True,
        }
    )
    assert request.thinking is False and request.temperature == 0.7 and request.top_p == 0.9
    assert request.max_tokens == 64 and request.stop == ("END",) and request.seed == 5 and request.stream
    assert request.tools == tuple(TOOLS) and request.tool_choice == "auto"


def test_history_with_tool_calls_and_content_parts(codec):
    request = codec.parse_request(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "r",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "result"},
            ],
        }
    )
    system, _, assistant, tool = request.messages
    assert system.content == "Be brief."
    assert assistant.tool_calls == (ToolCall("lookup", '{"q": "x"}', "c1"),) and assistant.reasoning == "r"
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "c1", "result")


def test_render_is_a_valid_chat_completion(codec):
    request = codec.parse_request(MINIMAL)
    result = ParsedOutput(content="Paris.", reasoning="Capital of France.")
    body = codec.render(request, result, {"prompt_tokens": 12, "completion_tokens": 5, "cached_tokens": 8}, "stop")
    completion = ChatCompletion.model_validate(body)
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == "deepseek-v4"
    assert choice.message.content == "Paris." and choice.finish_reason == "stop"
    assert choice.message.model_extra["reasoning_content"] == "Capital of France."
    assert completion.usage.total_tokens == 17 and completion.usage.prompt_tokens_details.cached_tokens == 8


def test_render_tool_calls(codec):
    request = codec.parse_request({**MINIMAL, "tools": TOOLS})
    result = ParsedOutput(tool_calls=(ToolCall("lookup", '{"q": "x"}'),))
    completion = ChatCompletion.model_validate(codec.render(request, result, {}, "stop"))
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup" and call.function.arguments == '{"q": "x"}' and call.id.startswith("call_")


def test_length_finish_reason(codec):
    body = codec.render(codec.parse_request(MINIMAL), ParsedOutput(content="tru"), {}, "length")
    assert ChatCompletion.model_validate(body).choices[0].finish_reason == "length"


def test_stream_frames_are_valid_chunks_and_accumulate(codec):
    request = codec.parse_request(
        {**MINIMAL, "stream": True, "stream_options": {"include_usage": True}, "tools": TOOLS}
    )
    events = [
        ParsedOutput(reasoning="think "),
        ParsedOutput(reasoning="more"),
        ParsedOutput(content="Hel"),
        ParsedOutput(content="lo"),
        ParsedOutput(tool_calls=(ToolCall("lookup", '{"q": "a"}'), ToolCall("lookup", '{"q": "b"}'))),
        ParsedOutput(finish_reason="stop", usage={"prompt_tokens": 4, "completion_tokens": 9}),
    ]
    frames = parse_frames(list(codec.stream(request, events)))
    assert frames[-1] == (None, "[DONE]") and all(event is None for event, _ in frames)
    chunks = [ChatCompletionChunk.model_validate(data) for _, data in frames[:-1]]
    assert len({c.id for c in chunks}) == 1
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    choice = final.choices[0]
    assert choice.message.content == "Hello" and choice.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in choice.message.tool_calls] == [
        ("lookup", '{"q": "a"}'),
        ("lookup", '{"q": "b"}'),
    ]
    assert final.usage.completion_tokens == 9 and chunks[-1].choices == []
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert reasoning == "think more"


def test_error_statuses(codec):
    for status, kind in ((404, "not_found_error"), (429, "rate_limit_error"), (503, "server_error")):
        out, body = codec.render_error(ProtocolError("nope", status=status, code="x"))
        error = ErrorObject.model_validate(body["error"])
        assert out == status and error.type == kind and error.code == "x"
    frame = parse_frames([codec.error_frame(ProtocolError("late", status=500))])
    assert frame[0][1]["error"]["message"] == "late"

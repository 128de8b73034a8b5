"""The official ``openai`` and ``anthropic`` SDKs, unmodified, against ``deepinfer serve`` on
SmolLM2-135M-Instruct: non-streamed and streamed calls on every endpoint, tool calls with a
tool-result round trip, the Responses API, legacy completions and the model list."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from serve_harness import MODEL

GREEDY = {"temperature": 0}  # anthropic 2.x no longer takes temperature as an argument; the API still does
QUESTION = "What is the capital of France?"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_chat_completion(oai):
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=30
    )
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens > 10 and reply.usage.completion_tokens > 0
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_completion_stream(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-1].usage.completion_tokens in (
        len(content_chunks),
        len(content_chunks) + 1,
    )  # + the end-of-turn token


def test_usage_reports_prefix_cache_hits(oai):
    """The same prompt twice: the second reuses every full KV block of the first (32 tokens)."""
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please, in a short list."}]
    first = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5)
    second = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5)
    block = 32  # the harness's block size
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // block * block


def test_messages_usage_reports_prefix_cache_hits(claude):
    """Anthropic's shape: cached prompt tokens in cache_read_input_tokens, the rest in input_tokens."""
    messages = [{"role": "user", "content": "List four animals that live in the sea, please, one per line."}]
    first = claude.messages.create(model=MODEL, max_tokens=5, extra_body=GREEDY, messages=messages)
    second = claude.messages.create(model=MODEL, max_tokens=5, extra_body=GREEDY, messages=messages)
    prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == prompt
    assert second.usage.cache_read_input_tokens == (prompt - 1) // 32 * 32 > 0  # every full block of the harness's 32


def test_messages(claude):
    reply = claude.messages.create(
        model=MODEL, max_tokens=30, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}]
    )
    assert reply.stop_reason == "end_turn"
    assert "Paris" in reply.content[0].text
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 10 and reply.usage.output_tokens > 0


def test_messages_stream(claude):
    with claude.messages.stream(
        model=MODEL, max_tokens=30, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text
    assert final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert (
        final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 10
    )  # message_start carried the prompt usage


def test_messages_name_the_stop_sequence_that_ended_them(claude):
    """Anthropic's ``stop_sequence`` names the matched stop (it was always null)."""
    kwargs = dict(
        model=MODEL,
        max_tokens=30,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": QUESTION}],
        stop_sequences=["zzz", "Paris"],
    )
    reply = claude.messages.create(**kwargs)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "Paris"
    assert "Paris" not in reply.content[0].text
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"
    assert final.content[0].text == reply.content[0].text


def test_responses(oai):
    reply = oai.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=30)
    assert reply.status == "completed"
    assert "Paris" in reply.output_text
    assert reply.usage.input_tokens > 10 and reply.usage.output_tokens > 0


def test_responses_stream(oai):
    events = list(oai.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=30, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris" in text
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == text


def test_completions(oai):
    reply = oai.completions.create(
        model=MODEL, prompt="The capital of France is the city of", max_tokens=4, temperature=0
    )
    assert "Paris" in reply.choices[0].text
    assert reply.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in oai.completions.create(
            model=MODEL, prompt="The capital of France is the city of", max_tokens=4, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == reply.choices[0].text


def test_models(oai, claude):
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert [m.id for m in claude.models.list()] == [MODEL]


def test_chat_tool_call_and_result_round_trip(oai):
    tools = [{"type": "function", "function": WEATHER_TOOL}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        temperature=0,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["parameters"])
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 22 degrees Celsius."},
    ]
    answer = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content.strip()
    assert not answer.choices[0].message.tool_calls


def test_chat_tool_call_streamed(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Tokyo?"}],
        tools=[{"type": "function", "function": WEATHER_TOOL}],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    # one call streamed in pieces (OpenAI's shape): the name on its first delta, the arguments joined
    assert [c.function.name for c in calls][:1] == ["get_weather"] and not any(c.function.name for c in calls[1:])
    assert {c.index for c in calls} == {0} and len(calls) > 1
    jsonschema.validate(json.loads("".join(c.function.arguments or "" for c in calls)), WEATHER_TOOL["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_messages_tool_use_and_result_round_trip(claude):
    tool = {
        "name": "get_weather",
        "description": WEATHER_TOOL["description"],
        "input_schema": WEATHER_TOOL["parameters"],
    }
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=60,
        extra_body=GREEDY,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=messages,
    )
    assert reply.stop_reason == "tool_use"
    use = [b for b in reply.content if b.type == "tool_use"][0]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_TOOL["parameters"])
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny and 22 degrees Celsius."}],
        },
    ]
    with claude.messages.stream(
        model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[tool], messages=messages
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content[0].type == "text" and final.content[0].text.strip()


def test_responses_function_call_round_trip(oai):
    tool = {"type": "function", **WEATHER_TOOL}
    reply = oai.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    call = [item for item in reply.output if item.type == "function_call"][0]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    follow_up = oai.responses.create(
        model=MODEL,
        tools=[tool],
        temperature=0,
        max_output_tokens=40,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny and 22 degrees Celsius."},
        ],
    )
    assert follow_up.output_text.strip()


def test_unset_sampling_fields_take_the_models_recommendation(oai, claude, served, monkeypatch):
    """The APIs document temperature 1 as their default, and SmolLM2-135M sampled at 1 answers
    this question with fiction; unset fields take the model card's values (0.2 / 0.9), so the
    plain SDK call a new user writes mostly gets a sensible answer. A value the request sends wins."""
    seen = []
    add = served.server.engine.add_request
    monkeypatch.setattr(
        served.server.engine, "add_request", lambda ids, params, **kw: seen.append(params) or add(ids, params, **kw)
    )

    def answers(**sampling):  # 8 seeds at once (one batch)
        def ask(seed):
            reply = oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, seed=seed, **sampling
            )
            return reply.choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(ask, range(1, 9)))

    unset = answers()
    assert {(p.temperature, p.top_p) for p in seen} == {(0.2, 0.9)}
    hot = answers(temperature=1.0, top_p=1.0)
    assert {(p.temperature, p.top_p) for p in seen[8:]} == {(1.0, 1.0)}
    assert sum("Paris" in a for a in unset) >= 6 > sum("Paris" in a for a in hot), (unset, hot)
    claude_reply = claude.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": QUESTION}])
    assert (seen[-1].temperature, seen[-1].top_p) == (0.2, 0.9) and claude_reply.content[0].text


def test_non_streamed_calls_get_no_snapshot_per_step_and_the_streamed_text(oai, claude, served, monkeypatch):
    """A non-streamed body (OpenAI chat, Anthropic messages) is a final_only request: the engine
    hands the server its first token's output and its last, not one snapshot per step, while a
    streamed call of the same request gets one per token; the SDKs read the same text both ways."""
    if served.server is None:
        pytest.skip("an external server: its engine is not in this process")
    engine = served.server.engine
    outputs: dict[str, list] = {}
    step = engine.step

    def counted():  # runs in the server's step thread
        outs = step()
        for o in outs:
            outputs.setdefault(o.request_id, []).append(o)
        return outs

    monkeypatch.setattr(engine, "step", counted)
    messages = [{"role": "user", "content": QUESTION}]

    def one_call(call):  # the outputs of the request that ``call`` makes, alone on the server
        served.wait_idle()
        outputs.clear()
        result = call()
        served.wait_idle()
        assert len(outputs) == 1
        return result, next(iter(outputs.values()))

    plain, plain_outs = one_call(
        lambda: (
            oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30)
            .choices[0]
            .message.content
        )
    )
    streamed, streamed_outs = one_call(lambda: "".join(c.choices[0].delta.content or "" for c in (
        oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30, stream=True))
        if c.choices))  # fmt: skip
    tokens = len(plain_outs[-1].outputs[0].token_ids)
    assert plain == streamed and "Paris" in plain and tokens > 3
    assert [o.finished for o in plain_outs] == [False, True] and len(plain_outs[0].outputs[0].token_ids) == 1
    assert len(streamed_outs) == tokens  # one snapshot per token
    assert streamed_outs[-1].outputs[0].token_ids == plain_outs[-1].outputs[0].token_ids
    reply, claude_outs = one_call(
        lambda: claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=messages).content[0].text
    )

    def claude_stream():
        with claude.messages.stream(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=messages) as stream:
            return "".join(stream.text_stream)

    text, claude_streamed = one_call(claude_stream)
    assert reply == text == plain
    assert [o.finished for o in claude_outs] == [False, True] and len(claude_streamed) == len(
        claude_streamed[-1].outputs[0].token_ids
    )

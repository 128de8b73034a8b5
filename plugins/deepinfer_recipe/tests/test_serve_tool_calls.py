"""Tool calls on a chat-template model (SmolLM2-135M-Instruct, no native tool format): the
Hermes ``<tool_call>`` syntax, the incremental parser, the structural-tag grammar and the three
APIs through the official SDKs.

A 135M model does not decide to call a tool by itself, so the ``auto`` tests force only the
start of a call (the five tokens of ``<tool_call>``); from there the real model writes the name
and arguments under the grammar, and the server must stream a call that validates against the
tool's schema, with no markup in the content.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import hypothesis
import jsonschema
import pytest
import torch
from hypothesis import strategies as st
from serve_harness import MODEL

from deepinfer_core.serve.tool_calls import HermesToolParser

# A strict schema the model would not meet by chance: an enum, a bounded integer, a pattern.
BOOKING = {
    "name": "book_table",
    "description": "Book a table at a restaurant",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome", "Oslo"]},
            "guests": {"type": "integer", "minimum": 1, "maximum": 8},
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        },
        "required": ["city", "guests", "time"],
        "additionalProperties": False,
    },
    "strict": True,
}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
}
TOOLS = [{"type": "function", "function": BOOKING}, {"type": "function", "function": WEATHER}]
SCHEMAS = {"book_table": BOOKING["parameters"], "get_weather": WEATHER["parameters"]}
ASK = "Book a table for two in Paris at eight tonight."


class ForcedStart:
    """Forces the first tokens of the output, then leaves the logits alone."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, output_token_ids, logits: torch.Tensor) -> torch.Tensor:
        n = len(output_token_ids)
        if n >= len(self.token_ids):
            return logits
        out = torch.full_like(logits, float("-inf"))
        out[self.token_ids[n]] = 0.0
        return out


@pytest.fixture
def start_with_call(served, monkeypatch):
    """The next requests' outputs begin with ``<tool_call>`` (after the grammar's own mask)."""
    preparer = served.server.preparer
    ids = preparer.tokenizer.encode("<tool_call>")
    real = type(preparer).prepare

    def prepare(self, conversation):
        prepared = real(self, conversation)
        assert prepared.params.logits_processors, "a tool request without a grammar"
        params = dataclasses.replace(
            prepared.params, logits_processors=[*prepared.params.logits_processors, ForcedStart(ids)]
        )
        return dataclasses.replace(prepared, params=params)

    monkeypatch.setattr(preparer, "prepare", prepare.__get__(preparer))


def check_call(name: str, arguments) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


# -- the parser, alone -----------------------------------------------------------------------
def test_parser_split_at_every_character():
    text = (
        'Sure.\n<tool_call>\n{"name": "book_table", "arguments": {"city": "Paris", "note": "窓際 🌍 <b>"}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\nDone. a < b <tool'
    )
    want_content = "Sure.\nDone. a < b <tool"
    want_calls = [("book_table", {"city": "Paris", "note": "窓際 🌍 <b>"}), ("get_weather", {})]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        parser, content, calls = HermesToolParser(), "", []
        for piece in pieces:
            out = parser.push(piece)
            assert "<tool_call" not in out.content and "</tool_call" not in out.content
            content, calls = content + out.content, calls + list(out.tool_calls)
        out = parser.finish()
        content, calls = content + out.content, calls + list(out.tool_calls)
        assert content == want_content
        assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls


def test_parser_gives_back_what_is_not_a_call():
    parser = HermesToolParser()
    out = parser.push('<tool_call>\nnot json\n</tool_call> then <tool_call>\n{"name": "x", "argu')
    end = parser.finish()
    assert out.content + end.content == '<tool_call>\nnot json\n</tool_call> then<tool_call>\n{"name": "x", "argu'
    assert not out.tool_calls and not end.tool_calls


# -- through the server ---------------------------------------------------------------------
def test_chat_auto_strict_call_streamed(oai, start_with_call):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=TOOLS,
        tool_choice="auto",
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert calls, content
    for entry in calls.values():
        check_call(entry["name"], entry["arguments"])
    assert "tool_call" not in content and "{" not in content
    assert finish == "tool_calls"


def test_chat_auto_call_not_streamed_then_result(oai, start_with_call):
    messages = [{"role": "user", "content": ASK}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=80)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls and not (message.content or "").strip()
    for call in message.tool_calls:
        check_call(call.function.name, call.function.arguments)


def test_messages_auto_strict_tool_use_streamed(claude, start_with_call):
    tools = [
        {
            "name": BOOKING["name"],
            "description": BOOKING["description"],
            "input_schema": BOOKING["parameters"],
            "strict": True,
        },
        {"name": WEATHER["name"], "input_schema": WEATHER["parameters"]},
    ]
    with claude.messages.stream(
        model=MODEL,
        max_tokens=80,
        extra_body={"temperature": 0},
        tools=tools,
        tool_choice={"type": "auto"},
        messages=[{"role": "user", "content": ASK}],
    ) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and final.stop_reason == "tool_use"
    for use in uses:
        check_call(use.name, use.input)
    assert all("tool_call" not in b.text for b in final.content if b.type == "text")


def test_responses_auto_strict_function_call_streamed(oai, start_with_call):
    tools = [
        {"type": "function", "name": BOOKING["name"], "parameters": BOOKING["parameters"], "strict": True},
        {"type": "function", "name": WEATHER["name"], "parameters": WEATHER["parameters"]},
    ]
    events = list(
        oai.responses.create(
            model=MODEL, input=ASK, tools=tools, tool_choice="auto", temperature=0, max_output_tokens=80, stream=True
        )
    )
    final = [e for e in events if e.type == "response.completed"][-1].response
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls
    for call in calls:
        check_call(call.name, call.arguments)
    assert "tool_call" not in final.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "tool_call" not in deltas


def test_auto_left_to_the_model_never_leaks_markup(oai):
    """No forcing: whatever SmolLM2 writes, a call is parsed and valid, and text has no tags."""
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        tools=TOOLS,
        temperature=0,
        max_tokens=60,
    )
    message = reply.choices[0].message
    assert "<tool_call>" not in (message.content or "") and "</tool_call>" not in (message.content or "")
    for call in message.tool_calls or ():
        check_call(call.function.name, call.function.arguments)


def test_required_on_messages_uses_a_declared_tool(claude):
    tools = [
        {"name": WEATHER["name"], "input_schema": WEATHER["parameters"]},
        {"name": BOOKING["name"], "input_schema": BOOKING["parameters"], "strict": True},
    ]
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=80,
        extra_body={"temperature": 0},
        tools=tools,
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Is it raining in Oslo?"}],
    )
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert uses and reply.stop_reason == "tool_use"
    for use in uses:
        check_call(use.name, use.input)


def test_strict_schema_that_cannot_compile_is_a_400_naming_tools(served):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": bad, "strict": True}}],
    }
    refused = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "tools" and "'f'" in refused.json()["error"]["message"]
    body["tools"][0]["function"]["strict"] = False  # not strict: any JSON object as arguments
    assert httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200


# -- a template that renders tools itself ----------------------------------------------------
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls | default([]) %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them():
    """Our prompt for a tool-aware template equals transformers' ``apply_chat_template`` with
    the same tools and Hugging Face's message shapes (tool calls with dict arguments)."""
    from transformers import PreTrainedTokenizerFast

    from deepinfer_core.chat_prompt import encode_chat
    from deepinfer_core.codecs import ConversationRequest, Message, ToolCall
    from deepinfer_core.models.sources import smollm2_gguf
    from deepinfer_core.serve.tool_calls import template_messages, template_renders_tools
    from deepinfer_core.tokenizer import Tokenizer

    smol = Tokenizer.from_gguf(smollm2_gguf())
    assert not template_renders_tools(smol.chat_template)  # SmolLM2's template: the generic prompt
    assert template_renders_tools(HERMES_TEMPLATE)
    ours = Tokenizer(
        smol.backend, bos_token_id=smol.bos_token_id, eos_token_id=smol.eos_token_id, chat_template=HERMES_TEMPLATE
    )
    request = ConversationRequest(
        messages=(
            Message(role="user", content=ASK),
            Message(
                role="assistant",
                tool_calls=(
                    ToolCall(name="book_table", arguments='{"city": "Paris", "guests": 2, "time": "20:00"}', id="c1"),
                ),
            ),
            Message(role="tool", content="Booked.", tool_call_id="c1"),
        ),
        tools=tuple(TOOLS),
        tool_choice="auto",
    )
    messages, variables = template_messages(request, native=True)
    _, text = encode_chat(ours, messages, add_generation_prompt=True, **variables)

    reference = PreTrainedTokenizerFast(tokenizer_object=smol.backend, chat_template=HERMES_TEMPLATE)
    hf_messages = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "book_table", "arguments": {"city": "Paris", "guests": 2, "time": "20:00"}},
                }
            ],
        },
        {"role": "tool", "content": "Booked."},
    ]
    assert text == reference.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "book_table"' in text and "Tools:" in text


@pytest.mark.parametrize(
    ("tools", "choice", "status"),
    [
        (
            [{"name": 'say "hi"\n', "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}],
            "required",
            200,
        ),  # name JSON-escaped
        ([{"name": "", "parameters": {"type": "object"}}], "auto", 200),
        ([{"name": "f"}, {"name": "f"}], "auto", 400),  # declared twice
        ([{"name": "f"}], {"type": "function", "function": {"name": "g"}}, 400),
        ([{"name": "f", "parameters": {"type": "object"}, "strict": "yes"}], "auto", 400),
    ],
)
def test_odd_tool_declarations_are_served_or_refused_never_500(served, tools, choice, status):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40,
        "temperature": 0,
        "tools": [{"type": "function", "function": f} for f in tools],
        "tool_choice": choice,
    }
    reply = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == status, reply.text
    if status == 200 and choice == "required":
        (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == tools[0]["name"] and isinstance(
            json.loads(call["function"]["arguments"]), dict
        )


def test_parser_streams_a_call_piece_by_piece_at_every_split():
    """The name as soon as the head is complete, then the arguments text in pieces that join to
    the finished call's arguments (kept as the model wrote them), whatever the chunking."""
    from deepinfer_core.codecs import ToolCallDelta

    args = '{"city": "Paris", "note": {"a": [1, 2], "b": "} </tool"}}'
    text = f'Hi <tool_call>\n{{"name": "book_table", "arguments": {args}}}\n</tool_call> bye'
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    head, end = text.index(args), text.index("</tool_call>") + len("</tool_call>")  # a split in between streams
    for pieces in splits:
        parser, deltas, calls = HermesToolParser(), [], []
        for piece in pieces:
            out = parser.push(piece)
            deltas += out.tool_call_deltas
            calls += out.tool_calls
        out = parser.finish()
        deltas, calls = deltas + list(out.tool_call_deltas), calls + list(out.tool_calls)
        assert [c.arguments for c in calls] == [args] and calls[0].name == "book_table"
        if len(pieces) > 2 or head < len(pieces[0]) < end:  # the head arrived before the end of the call
            assert deltas[0] == ToolCallDelta(calls[0].id, name="book_table")
            assert {d.id for d in deltas} == {calls[0].id}
            assert "".join(d.arguments for d in deltas) == args
    assert len(deltas) > 20  # one character at a time: streamed in many pieces


CHUNKED = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "deep": [{"x": "}"}, 2]}   }\n</tool_call>\n'
    '<tool_call>{"name": "raw", "arguments": "a string"}</tool_call>  \n'
    '<tool_call>\n{"name": "cut", "arguments": {"a": 1'
)
CHUNKED_CALLS = [("get_weather", '{"city": "Paris", "deep": [{"x": "}"}, 2]}'), ("raw", "a string"), ("cut", None)]


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(cuts=st.lists(st.integers(0, len(CHUNKED)), max_size=40))
def test_parser_any_chunking_gives_the_same_calls_and_streams(cuts):
    """Any chunking: content, calls and streamed pieces as written (pieces joined == each
    streamed call's arguments; a string argument comes whole when its call closes; the call cut by the end of
    the output streamed what it had and is given back as text at finish, not JSON)."""
    bounds = sorted(set(cuts))
    pieces = [CHUNKED[a:b] for a, b in zip([0, *bounds], [*bounds, len(CHUNKED)])]
    parser, content, calls, deltas = HermesToolParser(), "", [], []
    for piece in [*pieces, None]:
        out = parser.push(piece) if piece is not None else parser.finish()
        content, calls, deltas = (
            content + out.content,
            calls + list(out.tool_calls),
            deltas + list(out.tool_call_deltas),
        )
    assert content == 'Let me look.<tool_call>\n{"name": "cut", "arguments": {"a": 1'
    assert [(c.name, c.arguments) for c in calls] == CHUNKED_CALLS[:2]
    streamed = "".join(d.arguments for d in deltas if d.id == calls[0].id)
    head, end = CHUNKED.index('{"city"'), CHUNKED.index("</tool_call>")
    if any(head < b < end for b in bounds):  # a piece ended after the arguments began, before the end of the call
        assert streamed == CHUNKED_CALLS[0][1]
    else:  # the call arrived in one piece with its end: nothing to stream before it
        assert streamed in ("", CHUNKED_CALLS[0][1])
    names = {d.id: d.name for d in deltas if d.name}
    assert set(names.values()) <= {"get_weather", "raw", "cut"} and "cut" in names.values()
    assert "".join(d.arguments for d in deltas if names[d.id] == "raw") in (
        "",
        "a string",
    )  # a string: whole, at its end
    assert "".join(d.arguments for d in deltas if names[d.id] == "cut") == '{"a": 1'  # cut short: streamed what it had


def test_arguments_stream_piece_by_piece_on_every_api_and_join_to_the_whole_reply(oai, claude, start_with_call):
    """Chat deltas, Responses ``function_call_arguments.delta`` and Anthropic ``input_json_delta``
    carry the arguments in several pieces; joined, they are the non-streamed reply's."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=TOOLS, temperature=0, max_tokens=80)
    whole = oai.chat.completions.create(**chat).choices[0].message.tool_calls[0].function
    pieces = [
        c.choices[0].delta.tool_calls[0]
        for c in oai.chat.completions.create(**chat, stream=True)
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert pieces[0].function.name == whole.name and len(pieces) > 3
    assert "".join(p.function.arguments or "" for p in pieces) == whole.arguments
    check_call(whole.name, whole.arguments)

    tools = [
        {"type": "function", "name": f["function"]["name"], "parameters": f["function"]["parameters"]} for f in TOOLS
    ]
    resp = dict(model=MODEL, input=ASK, tools=tools, temperature=0, max_output_tokens=80)
    whole_r = [i for i in oai.responses.create(**resp).output if i.type == "function_call"][0]
    events = list(oai.responses.create(**resp, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 3 and "".join(deltas) == whole_r.arguments == done[0].arguments

    ant_tools = [{"name": f["function"]["name"], "input_schema": f["function"]["parameters"]} for f in TOOLS]
    msg = dict(
        model=MODEL,
        max_tokens=80,
        extra_body={"temperature": 0},
        tools=ant_tools,
        messages=[{"role": "user", "content": ASK}],
    )
    whole_m = [b for b in claude.messages.create(**msg).content if b.type == "tool_use"][0]
    with claude.messages.stream(**msg) as stream:
        partial = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    assert len(partial) > 3 and json.loads("".join(partial)) == whole_m.input
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(whole_m.name, whole_m.input)]


def test_a_client_gone_mid_tool_call_stream_and_a_bad_request_leave_the_others_alone(served, oai, monkeypatch):
    """While one client hangs up in the middle of a streamed tool call and another sends a
    malformed request, a third request gets exactly its solo reply; then nothing is left running."""
    import concurrent.futures

    preparer = served.server.preparer
    real, ids = type(preparer).prepare, preparer.tokenizer.encode("<tool_call>")

    def prepare(self, conversation):  # requests with tools begin with a call (as start_with_call)
        prepared = real(self, conversation)
        if not conversation.tools:
            return prepared
        params = dataclasses.replace(
            prepared.params, logits_processors=[*prepared.params.logits_processors, ForcedStart(ids)]
        )
        return dataclasses.replace(prepared, params=params)

    monkeypatch.setattr(preparer, "prepare", prepare.__get__(preparer))

    free = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], temperature=0, max_tokens=12)
    solo = oai.chat.completions.create(**free).choices[0].message.content

    def hang_up() -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": ASK}],
            "tools": TOOLS,
            "temperature": 0,
            "max_tokens": 80,
            "stream": True,
        }
        with httpx.stream("POST", f"{served.base_url}/v1/chat/completions", json=body, timeout=300) as reply:
            for line in reply.iter_lines():
                if '"tool_calls"' in line and '"arguments": "{' in line.replace('\\"', '"'):
                    return reply.status_code  # the arguments have begun: hang up here
        return -1

    def bad() -> int:
        return httpx.post(
            f"{served.base_url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            timeout=300,
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        gone, refused = pool.submit(hang_up), pool.submit(bad)
        other = pool.submit(lambda: oai.chat.completions.create(**free).choices[0].message.content)
        assert (gone.result(), refused.result(), other.result()) == (200, 400, solo)
    health = served.wait_idle()
    assert (health["in_flight"], health["running"], health["waiting"], health["kv_usage"]) == (0, 0, 0, 0.0), health

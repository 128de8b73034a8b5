"""The DeepSeek V4 output parser: golden parses, chunking invariance, held-back markers."""

from __future__ import annotations

import json
import random

import pytest
from recipe_testdata import GOLDEN

from deepinfer_core.codecs import ParsedOutput
from deepinfer_core.testing.codecs import OutputParserSuite
from deepinfer_recipe.deepseek_v4 import make_parser
from deepinfer_recipe.deepseek_v4.dsml import V4_1_TAGS

PARSE = {v["name"]: v for v in GOLDEN["parse"]}


def run(chunks, thinking: bool, **options) -> dict:
    """Feed chunks; return the joined result in the golden vectors' message shape."""
    parser = make_parser({"thinking": thinking, **options})
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


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.golden
def test_all_three_parse_vectors_present():
    assert len(PARSE) == 3


@pytest.mark.golden
@pytest.mark.parametrize("name", sorted(PARSE))
def test_golden_parse_whole(name):
    vector = PARSE[name]
    assert run([vector["completion"]], vector["thinking_mode"] == "thinking") == vector["parsed"]


@pytest.mark.golden
@pytest.mark.parametrize("name", sorted(PARSE))
def test_golden_parse_one_char_at_a_time(name):
    vector = PARSE[name]
    assert run(list(vector["completion"]), vector["thinking_mode"] == "thinking") == vector["parsed"]


@pytest.mark.golden
@pytest.mark.parametrize("name", sorted(PARSE))
@pytest.mark.parametrize("seed", range(40))
def test_golden_parse_random_splits(name, seed):
    vector = PARSE[name]
    chunks = random_split(vector["completion"], random.Random(f"{name}-{seed}"))
    assert run(chunks, vector["thinking_mode"] == "thinking") == vector["parsed"]


def test_partial_marker_is_held_back():
    parser = make_parser({"thinking": True})
    assert parser.push("Thinking hard</thi") == ParsedOutput(reasoning="Thinking hard")
    assert parser.push("nk>Answer") == ParsedOutput(content="Answer")


def test_lookalike_text_is_released_once_it_cannot_be_a_marker():
    parser = make_parser({"thinking": False})
    assert parser.push("a <｜DS") == ParsedOutput(content="a ")
    assert parser.push("x>") == ParsedOutput(content="<｜DSx>")


def test_newlines_before_think_close_kept_two_before_dsml_dropped():
    """As the reference parser (reference_behaviour.json: newlines_before_think_close_kept,
    three_newlines_before_tool_block)."""
    assert run(["idea\n\n", "</think>line1\n\nline2\n"], True) == {
        "role": "assistant",
        "content": "line1\n\nline2\n",
        "reasoning_content": "idea\n\n",
        "tool_calls": [],
    }
    block = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    out = run(["ok", "\n", "\n", block[2:]], False)
    assert out["content"] == "ok" and out["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_end_of_sentence_ends_parsing():
    assert run(["done.<｜end▁of▁sentence｜>ignored"], False)["content"] == "done."


def test_unterminated_tool_call_is_dropped_not_half_reported():
    text = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="q" string="true">par'
    assert run([text], False)["tool_calls"] == []


def test_tool_call_emitted_as_soon_as_its_invoke_closes():
    parser = make_parser({"thinking": False})
    parser.push(
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="n" string="false">7</｜DSML｜parameter>\n'
    )
    out = parser.push("</｜DSML｜invoke>\n")
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("f", {"n": 7})]


def test_v4_1_spelling_with_leading_space():
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="a" string="true">x</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    )
    out = run([text], False, dsml_calls_tag=V4_1_TAGS.calls)
    assert out["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": '{"a": "x"}'}}]


class TestDeepSeekV4ParserConformance(OutputParserSuite):
    @pytest.fixture(params=[True, False], ids=["thinking", "chat"])
    def make_parser(self, request):
        return lambda: make_parser({"thinking": request.param})

    @pytest.fixture
    def sample_outputs(self):
        return [v["completion"] for v in GOLDEN["parse"]] + [
            "plain 🌍 text\n",
            "a</think>b\n\n<｜DSML｜tool_calls></｜DSML｜tool_calls>",
        ]


PIECES = [
    "plain words ",
    "\n",
    "\n\n",
    "中文 ",
    "🌍",
    "</think>",
    "</thi",
    "<｜DSML",
    "｜DSML｜",
    "<｜end▁of▁sentence｜>",
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
    '<｜DSML｜parameter name="a" string="true">x\ny</｜DSML｜parameter>\n</｜DSML｜invoke>\n',
    '<｜DSML｜invoke name="g">\n'
    '<｜DSML｜parameter name="n" string="false">[1, {"k": null}]</｜DSML｜parameter>\n</｜DSML｜invoke>\n',
    "</｜DSML｜tool_calls>",
    "<",
    "</",
    "tool_calls>",
]


@pytest.mark.parametrize("seed", range(200))
def test_property_random_outputs_random_splits(seed):
    """Any output text, any split: the joined deltas equal the one-shot parse."""
    rng = random.Random(seed)
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 14)))
    thinking = rng.random() < 0.5
    whole = run([text], thinking)
    assert run(list(text), thinking) == whole
    if len(text) > 1:
        assert run(random_split(text, rng), thinking) == whole


def test_stop_sequences_apply_to_answer_text_only():
    text = "think END more</think>answer END ignored"
    for chunks in ([text], list(text)):
        parser = make_parser({"thinking": True, "stop": ("END",)})
        outs = [parser.push(c) for c in chunks] + [parser.finish()]
        assert "".join(o.reasoning for o in outs) == "think END more"
        assert "".join(o.content for o in outs) == "answer "
        assert [o.finish_reason for o in outs if o.finish_reason] == ["stop_sequence"]


def test_stop_sequences_do_not_cut_tool_arguments():
    text = (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="a" string="true">STOP</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    assert run([text], False, stop=("STOP",))["tool_calls"][0]["function"]["arguments"] == '{"a": "STOP"}'


@pytest.mark.parametrize("seed", range(20))
def test_long_arguments_with_bars_streamed_in_small_pieces(seed):
    """Long argument text with full-width bars and near-markers (the streaming fast path turns
    on and off): any chunking gives the one-shot parse."""
    rng = random.Random(seed)
    words = [
        "lorem ipsum dolor sit amet ",
        "｜",
        "a｜b ",
        "</｜DSML｜invok",
        "<｜end▁of▁sent",
        "\n",
        "</｜DSML｜tool_call",
        "中文 ",
    ]
    value = "".join(rng.choice(words) for _ in range(rng.randint(20, 200)))
    text = (
        'ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        f'<｜DSML｜parameter name="a" string="true">{value}</｜DSML｜parameter>\n'
        f'</｜DSML｜invoke>\n<｜DSML｜invoke name="g">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>tail'
    )
    whole = run([text], False)
    assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"a": value}
    pieces, i = [], 0
    while i < len(text):
        step = rng.randint(1, 7)
        pieces.append(text[i : i + step])
        i += step
    assert run(pieces, False) == whole


TRUNCATED_BLOCK = (
    '</think>ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
)


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (TRUNCATED_BLOCK, [("get_weather", '{"city": "Paris", "days": 3}')]),
        (
            TRUNCATED_BLOCK + '<｜DSML｜parameter name="unit" string="true">cel',
            [("get_weather", '{"city": "Paris", "days": 3}')],
        ),
        (TRUNCATED_BLOCK.split("<｜DSML｜parameter")[0], []),  # no complete parameter: no call
    ],
)
def test_a_block_cut_after_a_complete_parameter_returns_the_call(text, calls):
    """Issue 31.9: the model hit its limit after a complete parameter, ``</invoke>`` and
    ``</tool_calls>`` missing; DeepSeek's reference parser returns the call, ours dropped it.
    The call keeps its complete parameters (an open one is dropped), fed whole or one character
    at a time; pieces streamed under its id join to its arguments (where an open parameter was
    already streamed, the call comes whole under a new id, as an overlong header's does)."""
    from deepinfer_recipe.deepseek_v4.encoding import make_parser

    for chunks in ([text], list(text)):
        parser = make_parser({"thinking": True})
        outs = [parser.push(c) for c in chunks] + [parser.finish()]
        got = [(c.name, c.arguments) for o in outs for c in o.tool_calls]
        assert got == calls, chunks[:1]
        assert "".join(o.content for o in outs) == "ok"
        for call in (c for o in outs for c in o.tool_calls):
            streamed = "".join(d.arguments or "" for o in outs for d in o.tool_call_deltas if d.id == call.id)
            assert streamed in ("", call.arguments)

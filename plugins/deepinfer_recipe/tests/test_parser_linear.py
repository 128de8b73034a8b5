"""Every streaming output parser costs time linear in the text it is fed (issue 31.2).

The Hermes parser (chat-template models with tools) held whitespace by growing one string and
stripping it again on every piece: 2.8 s at 100 KB, over a minute at 1 MB. Each parser is fed
10 KB and then 1 MB of whitespace in two-character pieces (what a model emits when it loops on
blank lines), in the places it holds text back: plain answer text, reasoning, and a tool call's
arguments. Linear cost makes the ratio ~100; quadratic cost makes it ~10,000. The bound (400)
leaves room for a noisy machine, not for a quadratic parser.
"""

from __future__ import annotations

import time

import pytest

from deepinfer_core.serve.tool_calls import HermesToolParser
from deepinfer_recipe.deepseek_v4.encoding import make_parser

PIECE = " \n"
SMALL, LARGE = 10_000, 1_000_000
MAX_RATIO = 400

CALL_V4 = (
    '</think>x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">{"k":'
)
CASES = {
    "hermes-content": (HermesToolParser, "Hello"),
    "hermes-call-arguments": (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1,'),
    "v4-content": (lambda: make_parser({"thinking": True}), "</think>Hello"),
    "v4-reasoning": (lambda: make_parser({"thinking": True}), "Hmm"),
    "v4-call-arguments": (lambda: make_parser({"thinking": True}), CALL_V4),
}


def _feed(make, prefix: str, size: int) -> float:
    parser = make()
    parser.push(prefix)
    start = time.perf_counter()
    for _ in range(size // len(PIECE)):
        parser.push(PIECE)
    parser.finish()
    return time.perf_counter() - start


@pytest.mark.parametrize("case", list(CASES))
def test_a_parser_fed_1_mb_takes_about_100_times_as_long_as_for_10_kb(case):
    make, prefix = CASES[case]
    small = min(_feed(make, prefix, SMALL) for _ in range(3))
    large = _feed(make, prefix, LARGE)
    assert large / small < MAX_RATIO, f"{case}: 10 KB {small * 1e3:.1f} ms, 1 MB {large * 1e3:.0f} ms"


def test_whitespace_held_in_pieces_gives_the_same_output_as_one_push():
    """The pieces held back are joined again: the output of a call and text after whitespace
    runs is the same whether the text comes in one push or two characters at a time."""
    text = 'A  \n\n  <tool_call>{"name": "f", "arguments": {"a":   \n 1 \n }}  \n</tool_call>  \n  B \n '

    def run(pieces):
        parser = HermesToolParser()
        outs = [parser.push(p) for p in pieces] + [parser.finish()]
        content = "".join(o.content for o in outs)
        calls = [(c.name, c.arguments) for o in outs for c in o.tool_calls]
        streamed = "".join(d.arguments or "" for o in outs for d in o.tool_call_deltas)
        return content, calls, streamed

    whole = run([text])
    assert whole[0] == "A\nB \n " and whole[1] == [("f", '{"a":   \n 1 \n }')]
    assert run([text[i : i + 2] for i in range(0, len(text), 2)])[:2] == whole[:2]
    assert run(list(text))[:2] == whole[:2]
    assert run(list(text))[2] == whole[1][0][1]  # the streamed pieces join to the arguments

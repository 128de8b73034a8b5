"""DeepSeek-V4 output parser: a long tool argument streamed in small pieces vs fed whole.

A served model streams its tool-call arguments a few characters at a time; the parser must not
re-scan everything it holds on each piece (issue 7 measured 9.9 s for a 200 KB argument fed
4 characters at a time). The peer is the same parser fed the whole text in one call, measured
in the same run: streaming should stay within a small factor of it, at every size.

    python benchmarks/serve/parser_streaming.py                # 64 KB .. 1 MB, 4-character pieces
    python benchmarks/serve/parser_streaming.py --sizes 1048576 --piece 1 --repeats 5

Streamed is measured twice: with the parser as ``make_parser`` gives it (its C front where that
was built, see ``deepseek_v4/native.py``) and with its pure-Python quiet push (the fallback,
``accelerate=False``), and as the server makes it (``make_parser``: ``stream_calls``, the
call's name and argument pieces streamed as they come, every piece read in Python, no front).
The four runs of each repeat are interleaved, so a change in machine
load between them biases no column. Needs only the recipe plugin
(``pip install -e plugins/deepinfer_recipe``).
"""

from __future__ import annotations

import argparse
import json
import time

from deepinfer_recipe.deepseek_v4 import native, new_parser

D = "｜DSML｜"


def completion(size: int) -> str:
    """A tool call whose one string argument is ``size`` characters (multi-line, no markers)."""
    line = "The quick brown fox jumps over the lazy dog 0123456789.\n"
    value = (line * (size // len(line) + 1))[:size]
    return (
        f'Let me save it.\n\n<{D}tool_calls>\n<{D}invoke name="write_file">\n'
        f'<{D}parameter name="path" string="true">notes.txt</{D}parameter>\n'
        f'<{D}parameter name="text" string="true">{value}</{D}parameter>\n'
        f"</{D}invoke>\n</{D}tool_calls><｜end▁of▁sentence｜>"
    )


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def run(
    pieces: list[str], accelerate: bool = True, clock=time.perf_counter, stream_calls: bool = False
) -> tuple[float, int]:
    start = clock()
    parser = new_parser(thinking=False, accelerate=accelerate, stream_calls=stream_calls)
    outs = [parser.push(p) for p in pieces] + [parser.finish()]
    elapsed = clock() - start
    calls = [c for o in outs for c in o.tool_calls]
    assert len(calls) == 1
    if stream_calls:
        assert "".join(d.arguments for o in outs for d in o.tool_call_deltas) == calls[0].arguments
    return elapsed, len(json.loads(calls[0].arguments)["text"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="65536,262144,1048576", help="argument sizes in characters")
    ap.add_argument("--piece", type=int, default=4, help="characters per streamed piece")
    ap.add_argument("--repeats", type=int, default=3, help="best of R runs each")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or this thread's CPU time (on a busy shared machine: time spent waiting for a core is left "
        "out)",
    )
    args = ap.parse_args()
    clock = CLOCKS[args.clock]
    helper = native.load()
    print(
        f"streamed through: "
        f"{'the C front' if helper.module is not None and native.enabled() else 'the pure-Python push'}"
        f"{'' if helper.module is not None else ' (' + helper.reason + ')'}"
    )
    print(
        f"| argument | pieces of {args.piece} chars | streamed (s) | whole (s) | streamed / whole | pure-Python push "
        f"(s) | its ratio |"
        " streaming the call (s) | its ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        text = completion(size)
        pieces = [text[i : i + args.piece] for i in range(0, len(text), args.piece)]
        whole, streamed, python, deltas = [], [], [], []
        for _ in range(args.repeats):
            whole.append(run([text], clock=clock)[0])
            elapsed, got = run(pieces, clock=clock)
            assert got == size
            streamed.append(elapsed)
            python.append(run(pieces, accelerate=False, clock=clock)[0])
            deltas.append(run(pieces, clock=clock, stream_calls=True)[0])
        w, s_, p, d = min(whole), min(streamed), min(python), min(deltas)
        print(
            f"| {size / 1024:.0f} KiB | {len(pieces)} | {s_:.4f} | {w:.4f} | {s_ / w:.1f}x | {p:.4f} | {p / w:.1f}x | "
            f"{d:.4f} | {d / w:.1f}x |"
        )


if __name__ == "__main__":
    main()

"""Hermes tool-call parser (chat-template models): one call whose argument is N characters,
pushed in pieces of 4 characters (streamed: the consumer reads every delta) or in one piece
(the peer), best of R, same process. ``--before REV`` also times that revision's parser
(``git show REV:deepinfer_core/serve/tool_calls.py``, its one relative import made absolute)
so before and after share the run.

    .venv/bin/python benchmarks/serve/hermes_streaming.py --before 29eba82 --sizes 16384,65536,262144

Not part of the test suite: tests never time things.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parser_from(rev: str | None, work: str):
    if rev is None:
        from deepinfer_core.serve.tool_calls import HermesToolParser

        return HermesToolParser
    source = subprocess.run(
        ["git", "-C", REPO, "show", f"{rev}:deepinfer_core/serve/tool_calls.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = os.path.join(work, f"tool_calls_{rev}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source.replace("from ..codecs import", "from deepinfer_core.codecs import"))
    spec = importlib.util.spec_from_file_location(f"tool_calls_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HermesToolParser


def completion(size: int) -> str:
    value = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    return f'<tool_call>\n{{"name": "write_file", "arguments": {{"path": "a.txt", "text": "{value}"}}}}\n</tool_call>'


def run(cls, pieces: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    parser, streamed, calls = cls(), 0, 0
    for piece in pieces:
        out = parser.push(piece)
        streamed += sum(len(d.arguments) for d in out.tool_call_deltas)
        calls += len(out.tool_calls)
    calls += len(parser.finish().tool_calls)
    elapsed = time.perf_counter() - start
    assert calls == 1
    return elapsed, streamed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16384,65536,262144")
    ap.add_argument("--piece", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", metavar="REV")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        versions = {"now": parser_from(None, work)}
        if args.before:
            versions[args.before] = parser_from(args.before, work)
        print(
            f"| argument | pieces | {' | '.join(f'{v} streamed (s) | {v} whole (s) | {v} ratio' for v in versions)} |"
        )
        print("|---:|---:|" + "---:|---:|---:|" * len(versions))
        for size in (int(s) for s in args.sizes.split(",")):
            text = completion(size)
            pieces = [text[i : i + args.piece] for i in range(0, len(text), args.piece)]
            cells = []
            for cls in versions.values():
                streamed = min(run(cls, pieces)[0] for _ in range(args.repeats))
                whole = min(run(cls, [text])[0] for _ in range(args.repeats))
                cells.append(f"{streamed:.4f} | {whole:.4f} | {streamed / whole:.0f}x")
            print(f"| {size // 1024} KiB | {len(pieces)} | {' | '.join(cells)} |")
    print(f"\nload {os.getloadavg()[0]:.1f}, python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()

"""The greedy LM head alone: head.c's int16 head against head_screen.c's int8 screen (issue 11).

    .venv/bin/python benchmarks/lowbit_head_screen_ab.py --rows 1,4,8,16,32,64 --threads 1,2

Real inputs: the final-normed hidden rows SmolLM2's decode steps gave its head in a greedy run
(the default engine, ``--requests`` requests), and its real Q8_0 head (49,152 x 576). For each
row count M, batches of M of those rows go through both heads, alternating call by call in one
process, timed with the process's CPU clock (all threads together) and the wall clock; the
indices must be equal on every row (the screen is exact by construction, head_screen.c). Also
printed: the rows the screen recomputed exactly per call (the union of its candidates).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from lowbit_head_screen import hidden_states  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--calls", type=int, default=20, help="calls of each head per row count and thread count")
    args = parser.parse_args()
    from deepinfer_core.lowbit import native, ops

    hidden, w = hidden_states(args.requests, args.tokens)
    hidden = hidden.float().contiguous()
    start = time.process_time()
    screen = ops.prepare_screen(w)
    prep = time.process_time() - start
    assert screen is not None
    print(
        f"{hidden.shape[0]} hidden rows; head {tuple(w.shape)} {w.kind}; build {native.load().isa}; panel {screen.panel.numel() / 2**20:.1f} MiB "
        f"built in {prep * 1000:.0f} ms CPU; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "\n| threads | rows M | head.c CPU ms/call | screen CPU ms/call | CPU ratio | head.c wall ms | screen wall ms | rows recomputed (median, max) | equal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    big = ops.DEFAULT_INT_ROWS
    for threads in args.threads:
        for M in args.rows:
            cpu = {False: [], True: []}
            wall = {False: [], True: []}
            recomputed, equal = [], True
            for call in range(args.calls + 2):
                at = (call * M * 7) % max(1, hidden.shape[0] - M)
                x = hidden[at : at + M].contiguous()
                for screened in (False, True) if call % 2 else (True, False):
                    c0, w0 = time.process_time(), time.perf_counter()
                    if screened:
                        got, rows = ops.screened_head_argmax(x, w, screen, big, 0, threads)
                    else:
                        want = ops.head_argmax(x, w, big, 0, threads)
                    c1, w1 = time.process_time(), time.perf_counter()
                    if call >= 2:  # warm-up calls not timed
                        cpu[screened].append(c1 - c0)
                        wall[screened].append(w1 - w0)
                equal &= torch.equal(got, want)
                recomputed.append(rows)
            a, b = statistics.median(cpu[False]) * 1e3, statistics.median(cpu[True]) * 1e3
            print(
                f"| {threads} | {M} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {statistics.median(wall[False]) * 1e3:.2f} | "
                f"{statistics.median(wall[True]) * 1e3:.2f} | {statistics.median(recomputed):.0f}, {max(recomputed)} | {equal} |"
            )


if __name__ == "__main__":
    main()

"""The low-bit GEMM kernels alone, at SmolLM2-135M's shapes: exact (float32 activations) vs
integer (activations rounded to int16 per 32-block) and, for the 4-bit matrices, int8 (the
opt-in kernels_i8.c), same weights, same run.

    .venv/bin/python benchmarks/kernels/lowbit_kernels.py --rows 1,2,4,8,16,32 --threads 1

Weights are random packed blocks of the model's shapes (q4 for the layers, q8 for the tied
49,152 x 576 head); each (shape, M) cell is the best of 3 timings of enough calls for ~0.2 s.
Prints milliseconds per call and exact / integer (above 1: the integer kernel is faster). The
row count where the ratio falls below 1 was where ``ops.DEFAULT_INT_ROWS`` sat while the integer
kernel had only its rows layout; since kernels_i16.c's panel (5 rows on) it is every call
(``lowbit_i16.py`` compares the two kernels at prefill sizes too).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

SHAPES = (
    ("qkv", 960, 576, "q4"),
    ("o", 576, 576, "q4"),
    ("gate+up", 3072, 576, "q4"),
    ("down", 576, 1536, "q4"),
    ("head", 49152, 576, "q8"),
)


def packed(n: int, k: int, kind: str, seed: int | None = None):
    """A random packed weight [n, k] (q8: Q8_0 of normal values; q4: Q4_0 bytes), drawn from
    ``seed`` (default n + k)."""
    from deepinfer_core.lowbit.formats import QuantWeight, quantize_q8

    g = torch.Generator().manual_seed(n + k if seed is None else seed)
    if kind == "q8":
        return quantize_q8(torch.randn(n, k, generator=g))
    d = torch.rand(n, k // 32, generator=g) * 0.01
    return QuantWeight("q4", torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g), d, -8 * d, "Q4_0")


def best_ms(fn, clock=time.perf_counter, budget_s: float = 0.2, repeats: int = 3) -> float:
    fn()
    start = clock()
    fn()
    reps = max(1, int(budget_s / max(clock() - start, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(reps):
            fn()
        best = min(best, (clock() - start) / reps)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the calling thread's CPU time (with --threads 1 the kernel runs on it; time "
        "descheduled on a busy machine is not counted)",
    )
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    from deepinfer_core.lowbit import ops

    print(
        f"{args.threads} thread(s), {args.clock} clock, load average {os.getloadavg()[0]:.1f}, "
        f"{torch.backends.cpu.get_cpu_capability()}\n"
    )
    print("| matrix (N x K, kind) | M | exact ms | integer ms | exact / integer | int8 ms | exact / int8 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    totals: dict[int, list[float]] = {m: [0.0, 0.0, 0.0] for m in args.rows}
    for name, n, k, kind in SHAPES:
        w = packed(n, k, kind)
        for m in args.rows:
            x = torch.randn(m, k)
            exact = best_ms(lambda: ops.matmul(x, w, 0), clock)
            integer = best_ms(lambda: ops.matmul(x, w, m), clock)
            int8 = best_ms(lambda: ops.matmul(x, w, 0, 1), clock) if kind == "q4" else None
            totals[m][0] += exact * (1 if name == "head" else 30)
            totals[m][1] += integer * (1 if name == "head" else 30)
            totals[m][2] += (exact if int8 is None else int8) * (1 if name == "head" else 30)  # the head stays exact
            i8 = "–" if int8 is None else f"{int8:.3f} | {exact / int8:.2f}x"
            print(
                f"| {name} ({n} x {k}, {kind}) | {m} | {exact:.3f} | {integer:.3f} | {exact / integer:.2f}x | {i8} |"
                + (" – |" if int8 is None else ""),
                flush=True,
            )
    print("\nA whole decode step's GEMMs (30 layers + head; int8: the layers on int8, the q8 head exact):\n")
    print("| M | exact ms | integer ms | exact / integer | int8 ms | exact / int8 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m, (exact, integer, int8) in totals.items():
        print(f"| {m} | {exact:.1f} | {integer:.1f} | {exact / integer:.2f}x | {int8:.1f} | {exact / int8:.2f}x |")


if __name__ == "__main__":
    main()

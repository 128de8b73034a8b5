"""The whole low-bit library (every C source and vec.h) of another git revision against this
checkout's, in one process: q5 GEMMs at decode row counts, the fused LM head, and optionally
whole runs; outputs compared bit for bit, the two libraries alternating.

    .venv/bin/python benchmarks/lowbit_lib_ab.py --rev main --isa avx2
    .venv/bin/python benchmarks/lowbit_lib_ab.py --rev main --isa avx2 --run-ab 3 --requests 32 --threads 1

Why another script than ``lowbit_i16_ab.py``: that one swaps kernels_i16.c only and compiles
every other file (vec.h included) from this checkout, so a change in vec.h (the q5 widening) or
head.c is on both of its sides. Here each side is built from its own revision's files. Cells:
thread CPU time of one thread, best of ``--repeats`` timings of ~0.2 s each, sides alternating.
Weights: random packed blocks of SmolLM2-135M's shapes (q5 with random fifth bits, as the
Q4_K_M file's Q5_0 layers; the q8 49,152 x 576 tied head). ``--run-ab`` hands both libraries
to ``lowbit_i16_ab.run_ab`` (whole ``cpu_throughput.py``-shaped runs, the model's native calls
and GEMMs on one library then the other).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from lowbit_i16_ab import run_ab  # noqa: E402
from lowbit_kernels import packed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Q5_SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate+up", 3072, 576), ("down", 576, 1536))


def build(rev: str | None, out_dir: str, name: str, isa: str) -> ctypes.CDLL:
    """The library from ``rev``'s files (None: this checkout's) for ``isa``."""
    from deepinfer_core.lowbit import native

    src_dir = os.path.join(out_dir, name)
    os.makedirs(src_dir)
    paths = []
    for path in native._SOURCES + native._HEADERS:
        rel = os.path.relpath(path, ROOT)
        if rev is None:
            with open(path) as f:
                text = f.read()
        else:
            text = subprocess.run(
                ["git", "-C", ROOT, "show", f"{rev}:{rel}"], check=True, capture_output=True, text=True
            ).stdout
        with open(os.path.join(src_dir, os.path.basename(path)), "w") as f:
            f.write(text)
        if path.endswith(".c"):
            paths.append(os.path.join(src_dir, os.path.basename(path)))
    so = os.path.join(out_dir, f"{name}.so")
    subprocess.run([native.compiler_path(), *native._FLAGS, *native._ISA_FLAGS[isa], "-o", so, *paths], check=True)
    lib = ctypes.CDLL(so)
    native._declare(lib)
    return lib


def q5(n: int, k: int):
    from deepinfer_core.lowbit.formats import QuantWeight

    g = torch.Generator().manual_seed(n + k)
    d = torch.rand(n, k // 32, generator=g) * 0.01
    return QuantWeight(
        "q5", torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8, generator=g), d, -16 * d, "Q5_0"
    )


def best_pair(fns: dict, repeats: int) -> dict:
    clock = time.thread_time
    for fn in fns.values():
        fn()
    start = clock()
    fns["before"]()
    reps = max(1, int(0.2 / max(clock() - start, 1e-6)))
    best = {side: float("inf") for side in fns}
    for _ in range(repeats):
        for side, fn in fns.items():
            start = clock()
            for _ in range(reps):
                fn()
            best[side] = min(best[side], (clock() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="main", help="git revision of the 'before' library")
    parser.add_argument(
        "--isa", default="avx2", help="instruction set both libraries are built for (native._ISA_FLAGS)"
    )
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--head-rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--run-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="then ROUNDS whole runs per library (lowbit_i16_ab.run_ab)",
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="threads of --run-ab's runs (the cells run one thread)")
    args = parser.parse_args()
    from deepinfer_core.lowbit import ops
    from deepinfer_core.lowbit.formats import KIND_CODE

    with tempfile.TemporaryDirectory() as tmp:
        libs = {"before": build(args.rev, tmp, "before", args.isa), "after": build(None, tmp, "after", args.isa)}
        print(
            f"low-bit library of {args.rev} (before) vs this checkout (after), both built for {args.isa}; one thread, thread CPU, "
            f"best of {args.repeats}, load average {os.getloadavg()[0]:.1f}\n"
        )
        print("| call | M | before ms | after ms | before / after | bits equal |")
        print("|---|---:|---:|---:|---:|---|")
        for name, n, k in Q5_SHAPES:
            w = q5(n, k)
            for exact in (False, True):
                for m in args.rows if not exact else args.rows[:1]:
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
                    ys = {side: torch.empty(m, n) for side in libs}

                    def fn(side, exact=exact, x=x, w=w, m=m, k=k, n=n):
                        f = libs[side].gemm_f32_act if exact else libs[side].gemm_i16_act
                        f(
                            x.data_ptr(),
                            m,
                            k,
                            KIND_CODE["q5"],
                            w.qs.data_ptr(),
                            w.d.data_ptr(),
                            w.m.data_ptr(),
                            n,
                            ys[side].data_ptr(),
                            1,
                        )

                    best = best_pair({side: (lambda side=side: fn(side)) for side in libs}, args.repeats)
                    equal = torch.equal(ys["before"].view(torch.int32), ys["after"].view(torch.int32))
                    b, a = best["before"] * 1e3, best["after"] * 1e3
                    label = f"{name} ({n} x {k}, q5, {'exact float32' if exact else 'int16'})"
                    print(
                        f"| {label} | {m} | {b:.4f} | {a:.4f} | {b / a:.2f}x | {'yes' if equal else 'NO'} |", flush=True
                    )
        head = packed(49152, 576, "q8", 7)
        for m in args.head_rows:
            x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
            outs = {side: torch.empty(m, dtype=torch.int64) for side in libs}

            def fn(side, x=x, m=m):  # noqa: F811 (one timing function per loop pass)
                libs[side].lowbit_head_argmax(
                    x.data_ptr(),
                    m,
                    576,
                    KIND_CODE["q8"],
                    head.qs.data_ptr(),
                    head.d.data_ptr(),
                    None,
                    49152,
                    ops.DEFAULT_INT_ROWS,
                    0,
                    1,
                    outs[side].data_ptr(),
                )

            best = best_pair({side: (lambda side=side: fn(side)) for side in libs}, args.repeats)
            b, a = best["before"] * 1e3, best["after"] * 1e3
            equal = torch.equal(outs["before"], outs["after"])
            print(
                f"| fused LM head + argmax (49152 x 576, q8) | {m} | {b:.3f} | {a:.3f} | {b / a:.2f}x | {'yes' if equal else 'NO'} |",
                flush=True,
            )
        if args.run_ab:
            torch.set_num_threads(args.threads)
            print()
            run_ab(libs, args.requests, args.run_ab, args.rev)


if __name__ == "__main__":
    main()

"""Decode attention over the paged KV cache alone (lowbit/attention.c), float32 vs float16 vs int8
cache, at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head width 64, 30 layers), same run.

    .venv/bin/python benchmarks/kernels/decode_attention.py --requests 1,8,32 --context 192 --threads 1
    .venv/bin/python benchmarks/kernels/decode_attention.py --dtypes float16,int8 --requests 32 --clock cpu

Each request's context of ``--context`` tokens lies in scattered 16-token blocks of a cache
sized to the batch (as the engine's): a step = one call per layer over its own cache tensor
(30 tensors, so the caches do not all sit in the CPU's caches). The two dtypes alternate per
repeat; each cell is the best of ``--repeats`` timings of one whole step (the calling process's
CPU time with ``--clock cpu``, for a busy machine). Prints ms per step and each dtype's time over
the first one's. An int8 cache holds rows of 64 codes + a float32 scale (68 bytes), written by
the engine's own quantizer (``paged_write_kv``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


def _cache(lib, g, blocks: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(2, KV_HEADS, blocks, BLOCK, HEAD_DIM, generator=g)
    if dtype != torch.int8:
        return x.to(dtype)
    cache = torch.empty(2, KV_HEADS, blocks, BLOCK, HEAD_DIM + 4, dtype=torch.int8)
    k, v = (x[i].reshape(KV_HEADS, -1, HEAD_DIM).transpose(0, 1).contiguous() for i in (0, 1))  # [slots, Hkv, D]
    slots = torch.arange(blocks * BLOCK)
    lib.paged_write_kv(
        k.data_ptr(),
        v.data_ptr(),
        cache.data_ptr(),
        KV_HEADS,
        blocks,
        BLOCK,
        HEAD_DIM + 4,
        HEAD_DIM,
        HEAD_DIM,
        slots.data_ptr(),
        blocks * BLOCK,
        2,
    )
    return cache


def step_inputs(lib, requests: int, context: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(requests)
    per = -(-context // BLOCK)
    blocks = requests * per + 1
    caches = [_cache(lib, g, blocks, dtype) for _ in range(LAYERS)]
    tables = torch.randperm(blocks, generator=g)[: requests * per].reshape(requests, per).int()
    q = torch.randn(requests, HEADS, HEAD_DIM, generator=g)
    positions = torch.full((requests,), context - 1, dtype=torch.long)
    return caches, tables, q, positions


def run_step(lib, caches, tables, q, positions, out, threads: int) -> None:
    kind = {torch.float32: 0, torch.float16: 1, torch.int8: 2}[caches[0].dtype]
    blocks, width = caches[0].shape[2], caches[0].shape[4]
    for cache in caches:
        lib.paged_decode_attention(
            q.data_ptr(),
            cache.data_ptr(),
            KV_HEADS,
            blocks,
            BLOCK,
            width,
            HEADS,
            HEAD_DIM,
            HEAD_DIM,
            tables.data_ptr(),
            tables.shape[1],
            positions.data_ptr(),
            q.shape[0],
            HEAD_DIM**-0.5,
            0,
            out.data_ptr(),
            threads,
            kind,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument(
        "--dtypes",
        type=lambda s: s.split(","),
        default=["float32", "float16"],
        help="cache dtypes: float32, float16, int8",
    )
    args = parser.parse_args()
    from deepinfer_core.lowbit import native

    lib = native.load().lib
    if lib is None:
        raise SystemExit(f"low-bit kernels unavailable: {native.load().reason}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(
        f"{args.threads} thread(s), {args.clock} clock, load average {os.getloadavg()[0]:.1f}, context {args.context} "
        f"tokens"
    )
    names = args.dtypes
    print(
        f"| requests | KV bytes read / step | {' | '.join(f'{n} ms' for n in names)} | "
        f"{' | '.join(f'{names[0]} / {n}' for n in names[1:])} |"
    )
    print("|---:|---:|" + "---:|" * (2 * len(names) - 1))
    for R in args.requests:
        inputs = {DTYPES[n]: step_inputs(lib, R, args.context, DTYPES[n]) for n in names}
        out = torch.empty(R, HEADS, HEAD_DIM)
        best = {dt: float("inf") for dt in inputs}
        for _ in range(args.repeats):
            for dt, (caches, tables, q, positions) in inputs.items():
                t0 = clock()
                run_step(lib, caches, tables, q, positions, out, args.threads)
                best[dt] = min(best[dt], (clock() - t0) * 1e3)
        rows = LAYERS * 2 * KV_HEADS * R * args.context
        row_bytes = {"float32": HEAD_DIM * 4, "float16": HEAD_DIM * 2, "int8": HEAD_DIM + 4}
        mb = " / ".join(f"{rows * row_bytes[n] / 1e6:.0f} MB ({n})" for n in names)
        times = [best[DTYPES[n]] for n in names]
        print(
            f"| {R} | {mb} | {' | '.join(f'{t:.2f}' for t in times)} | "
            f"{' | '.join(f'{times[0] / t:.2f}x' for t in times[1:])} |"
        )


if __name__ == "__main__":
    main()

"""Decode attention over the paged KV cache alone (lowbit/attention.c), float32 vs float16 cache,
at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head width 64, 30 layers), same run.

    .venv/bin/python benchmarks/decode_attention.py --requests 1,8,32 --context 192 --threads 1

Each request's context of ``--context`` tokens lies in scattered 16-token blocks of a cache
sized to the batch (as the engine's): a step = one call per layer over its own cache tensor
(30 tensors, so the caches do not all sit in the CPU's caches). The two dtypes alternate per
repeat; each cell is the best of ``--repeats`` timings of one whole step (the calling process's
CPU time with ``--clock cpu``, for a busy machine). Prints ms per step and float32 / float16.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def step_inputs(requests: int, context: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(requests)
    per = -(-context // BLOCK)
    blocks = requests * per + 1
    caches = [torch.randn(2, KV_HEADS, blocks, BLOCK, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(blocks, generator=g)[: requests * per].reshape(requests, per).int()
    q = torch.randn(requests, HEADS, HEAD_DIM, generator=g)
    positions = torch.full((requests,), context - 1, dtype=torch.long)
    return caches, tables, q, positions


def run_step(lib, caches, tables, q, positions, out, threads: int) -> None:
    f16 = caches[0].dtype == torch.float16
    blocks = caches[0].shape[2]
    for cache in caches:
        lib.paged_decode_attention(q.data_ptr(), cache.data_ptr(), KV_HEADS, blocks, BLOCK, HEAD_DIM, HEADS, HEAD_DIM, HEAD_DIM,
                                   tables.data_ptr(), tables.shape[1], positions.data_ptr(), q.shape[0], HEAD_DIM**-0.5, 0,
                                   out.data_ptr(), threads, f16)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    from deepinfer_core.lowbit import native

    lib = native.load().lib
    if lib is None:
        raise SystemExit(f"low-bit kernels unavailable: {native.load().reason}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"{args.threads} thread(s), {args.clock} clock, load average {os.getloadavg()[0]:.1f}, context {args.context} tokens")
    print("| requests | KV bytes read / step | float32 ms | float16 ms | float32 / float16 |\n|---:|---:|---:|---:|---:|")
    for R in args.requests:
        inputs = {dt: step_inputs(R, args.context, dt) for dt in (torch.float32, torch.float16)}
        out = torch.empty(R, HEADS, HEAD_DIM)
        best = {dt: float("inf") for dt in inputs}
        for _ in range(args.repeats):
            for dt, (caches, tables, q, positions) in inputs.items():
                t0 = clock()
                run_step(lib, caches, tables, q, positions, out, args.threads)
                best[dt] = min(best[dt], (clock() - t0) * 1e3)
        mb = LAYERS * 2 * KV_HEADS * R * args.context * HEAD_DIM * 4 / 1e6
        f32, f16 = best[torch.float32], best[torch.float16]
        print(f"| {R} | {mb:.0f} MB (fp32) / {mb / 2:.0f} MB (fp16) | {f32:.2f} | {f16:.2f} | {f32 / f16:.2f}x |")


if __name__ == "__main__":
    main()

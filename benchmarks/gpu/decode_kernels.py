"""Kernel by kernel: what one replay of a captured decode graph spends its GPU time on.

    python benchmarks/gpu/decode_kernels.py --levels 16,64              # random V3-mini, bf16
    python benchmarks/gpu/decode_kernels.py --levels 64 --fp8           # then the same checkpoint in FP8

Builds the random V3-mini of ``gpu_throughput.py`` (same seed, same config), starts the engine
with its decode graphs, times decode at each level as ``gpu_throughput.py`` does (so the graphs
hold a real batch: 128-token prompts + 33 tokens), then per level: the replay's GPU time (CUDA
events over 50 replays) and every kernel of one replay (torch profiler over 20 replays: ms per
step, launches per step), and the sum of kernel time against the replay (the rest is the gaps
between kernels). With ``--json`` the tables are written for the README."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_throughput import (
    V3_MINI,
    copy_bandwidth,
    di,
    di_speed,
    free,
    kernel_table,
    log,
    make_fp8,
    make_v3mini,
    replay_ms,
)  # noqa: E402


def measure(name: str, path: str, levels: list[int], out: dict) -> None:
    llm = di(
        path, "bfloat16", max_num_seqs=max(levels), max_num_batched_tokens=8192, kv_cache_blocks=max(levels) * 2 + 64
    )
    vocab = V3_MINI["vocab_size"]
    dec = di_speed(llm, vocab, levels, 32, 128)
    graphs = llm.engine.runner.graphs
    for n in levels:
        g = graphs.graphs[n]
        t = min(replay_ms(g) for _ in range(3))
        rows = kernel_table(g.replay)
        total = sum(r[1] for r in rows)
        launches = sum(r[2] for r in rows)
        log(
            f"KERNELS {name} N={n}: step {dec[n]:.3f} ms, replay {t:.3f} ms, {launches:.0f} kernels, {total:.3f} ms "
            f"kernel time, gaps {t - total:.3f} ms"
        )
        for k, ms, c in rows:
            log(f"  {ms:7.4f} ms {c:5.0f}x  {k[:150]}")
        out[f"{name}-{n}"] = {"step_ms": dec[n], "replay_ms": t, "kernels": rows}
    del llm, graphs
    free()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="16,64")
    ap.add_argument(
        "--fp8", action="store_true", help="also the same checkpoint in DeepSeek's FP8 block format (after bf16)"
    )
    ap.add_argument("--fp8-levels", default="64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s (read+write)")
    out: dict = {"copy_bw": bw}
    tmp = tempfile.mkdtemp(prefix="v3mini")
    t = time.perf_counter()
    make_v3mini(tmp)
    log(f"checkpoint written in {time.perf_counter() - t:.0f}s")
    measure("bf16", tmp, [int(x) for x in args.levels.split(",")], out)
    if args.fp8:
        make_fp8(tmp)
        measure("fp8", tmp, [int(x) for x in args.fp8_levels.split(",")], out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

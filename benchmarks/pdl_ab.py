"""The one-request bf16 decode step with programmatic dependent launch off and on (A/B).

    python benchmarks/pdl_ab.py --rounds 2

Builds the random V3-mini of ``gpu_throughput.py`` once, then alternates engines started with
``DEEPINFER_PDL=0`` and ``=1`` (one request, its decode graph only): decode ms/step as
``gpu_throughput.py`` times it, the graph's replay (CUDA events, best of 3 x 50 replays), and the
greedy tokens of 4 prompts x 32 new tokens, which must be the same for both settings. The last
PDL-on engine's graph is also profiled kernel by kernel (the profiler may serialise launches:
the replay is the figure)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_throughput import (
    V3_MINI,
    di,
    di_greedy,
    di_speed,
    free,
    kernel_table,
    log,
    make_v3mini,
    random_prompts,
    replay_ms,
)  # noqa: E402


def one(path: str, pdl: str, table: bool) -> tuple[float, float, list]:
    os.environ["DEEPINFER_PDL"] = pdl
    llm = di(path, "bfloat16", max_num_seqs=1, max_num_batched_tokens=8192, kv_cache_blocks=96)
    vocab = V3_MINI["vocab_size"]
    step = di_speed(llm, vocab, [1], 32, 128)[1]
    g = llm.engine.runner.graphs.graphs[1]
    rep = min(replay_ms(g) for _ in range(3))
    toks = di_greedy(llm, random_prompts(4, 24, vocab, 5), 32)
    log(f"PDL={pdl}: step {step:.3f} ms, replay {rep:.4f} ms")
    if table:
        rows = kernel_table(g.replay)
        log(f"  {sum(r[2] for r in rows):.0f} kernels, {sum(r[1] for r in rows):.4f} ms kernel time (profiled)")
        for k, ms, c in rows:
            log(f"  {ms:7.4f} ms {c:5.0f}x  {k[:110]}")
    del llm, g
    free()
    return step, rep, toks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="v3mini")
    make_v3mini(tmp)
    res: dict[str, list] = {"0": [], "1": []}
    for r in range(args.rounds):
        for pdl in ("0", "1"):
            res[pdl].append(one(tmp, pdl, table=r == args.rounds - 1 and pdl == "1"))
    same = all(t[2] == res["0"][0][2] for v in res.values() for t in v)
    for pdl, v in res.items():
        log(
            f"SUMMARY PDL={pdl}: steps {', '.join(f'{t[0]:.3f}' for t in v)} ms, replays {', '.join(f'{t[1]:.4f}' for t in v)} ms"
        )
    log(f"SUMMARY greedy tokens identical across all engines: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

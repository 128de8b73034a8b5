"""The int16-activation GEMM (kernels_i16.c) against the exact float32-activation one (kernels.c),
same weights, same process, the two alternating per cell.

    .venv/bin/python benchmarks/kernels/lowbit_i16.py --rows 1,8,32,4096 --threads 1 --clock cpu

Two tables:

1. Each of SmolLM2-135M's matrices alone (random packed blocks of its shapes: q4 for the layers,
   q8 for the tied 49,152 x 576 head; the head only up to 256 rows, as no step multiplies more
   rows by it): ms per call, GFLOP/s (2 M N K per call) and exact / int16 (above 1: int16 faster).
   Best of 3 timings of enough calls for ~0.2 s; one matrix's weights stay in cache.
2. A whole step's GEMMs with 30 distinct layers (as the model: ~70 MB of packed weights, read
   from memory each step) plus the head for decode-sized M: the two kernels alternate, best of 3.

3. With ``--engine-steps``: the default engine on SmolLM2's Q4_1 GGUF, a 2,048-token prefill step
   (16 prompts of 128 tokens) and decode steps of ``--requests`` requests, thread CPU time per
   step, with every low-bit module set to each variant in turn (the variants alternate step by
   step): float32 activations everywhere, int16 for calls of <= 4 rows (the default until
   2026-12-01), int16 everywhere (the default now).

4. With ``--run-ab ROUNDS``: whole runs shaped as ``cpu_throughput.py``'s (``--requests`` prompts of
   128 tokens, 128 new tokens, greedy, EOS ignored, one ``generate``), the earlier default (int16
   for <= 4 rows) and the default now alternating; wall and process CPU seconds.

The row count where table 1's ratio passes 1 is where the panel layout starts to pay
(kernels_i16.c's P16_MIN_M).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

LAYER = (("qkv", 960, 576), ("o", 576, 576), ("gate+up", 3072, 576), ("down", 576, 1536))
HEAD = ("head", 49152, 576)

sys.path.insert(0, os.path.dirname(__file__))
from lowbit_kernels import best_ms, packed  # noqa: E402  (the same random weights and timer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 4096])
    parser.add_argument(
        "--step-rows",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 32],
        help="M of table 2 (each: 30 layers' four GEMMs, and the head up to 256 rows)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine-steps", action="store_true", help="table 3 only: whole engine steps")
    parser.add_argument("--requests", type=int, default=32, help="table 3's decode batch")
    parser.add_argument("--rounds", type=int, default=2, help="table 3's rounds")
    parser.add_argument(
        "--run-ab", type=int, default=0, metavar="ROUNDS", help="table 4 only: whole runs, before vs now"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the calling thread's CPU time (use with --threads 1)",
    )
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    from deepinfer_core.lowbit import ops

    every = ops.DEFAULT_INT_ROWS
    print(
        f"{args.threads} thread(s), {args.clock} clock, load average {os.getloadavg()[0]:.1f}, "
        f"{torch.backends.cpu.get_cpu_capability()}\n"
    )
    if args.run_ab:
        run_ab(args.requests, args.run_ab)
        return
    if args.engine_steps:
        engine_steps(args.requests, args.rounds, clock)
        return
    print("| matrix (N x K, kind) | M | exact ms | exact GFLOP/s | int16 ms | int16 GFLOP/s | exact / int16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (name, n, k), kind in [(s, "q4") for s in LAYER] + [(HEAD, "q8")]:
        w = packed(n, k, kind, n + k)
        for m in args.rows:
            if name == "head" and m > 256:
                continue
            x = torch.randn(m, k)
            exact = best_ms(lambda: ops.matmul(x, w, 0), clock)
            i16 = best_ms(lambda: ops.matmul(x, w, every), clock)
            flop = 2 * m * n * k
            print(
                f"| {name} ({n} x {k}, {kind}) | {m} | {exact:.3f} | {flop / exact / 1e6:.1f} | {i16:.3f} | "
                f"{flop / i16 / 1e6:.1f} | {exact / i16:.2f}x |",
                flush=True,
            )

    layers = [[packed(n, k, "q4", 100 * layer + i) for i, (_, n, k) in enumerate(LAYER)] for layer in range(30)]
    head = packed(HEAD[1], HEAD[2], "q8", 7)
    print("\nA step's GEMMs, 30 distinct layers (weights from memory) + the head up to 256 rows:\n")
    print("| M | exact ms | int16 ms | exact / int16 | GFLOP/s exact | GFLOP/s int16 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in args.step_rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        flop = 30 * sum(2 * m * n * k for _, n, k in LAYER) + (2 * m * HEAD[1] * HEAD[2] if m <= 256 else 0)

        def step(rows: int) -> None:
            for layer in layers:
                for w in layer:
                    ops.matmul(xs[w.shape[1]], w, rows)
            if m <= 256:
                ops.matmul(xs[576], head, rows)

        best = {0: float("inf"), every: float("inf")}
        for _ in range(3):
            for rows in best:
                start = clock()
                step(rows)
                best[rows] = min(best[rows], (clock() - start) * 1e3)
        exact, i16 = best[0], best[every]
        print(
            f"| {m} | {exact:.1f} | {i16:.1f} | {exact / i16:.2f}x | {flop / exact / 1e6:.1f} | {flop / i16 / 1e6:.1f} "
            f"|",
            flush=True,
        )


def run_ab(requests: int, rounds: int) -> None:
    import inspect
    import sys

    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.builtin.lowbit import llama_decode
    from deepinfer_core.lowbit import ops
    from deepinfer_core.lowbit.modules import LowBitEmbedding, LowBitLinear

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu"))
    from cpu_throughput import build_prompts

    prompts = build_prompts(requests, 128)
    block_size = inspect.signature(LLM).parameters["block_size"].default
    llm = LLM(
        "smollm2-135m-instruct",
        device="cpu",
        max_num_seqs=requests,
        kv_cache_blocks=requests * -(-256 // block_size),
        enable_prefix_caching=False,
    )
    model = llm.engine.model
    modules = [m for m in model.modules() if isinstance(m, (LowBitLinear, LowBitEmbedding))]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(
        [p[::-1] for p in prompts], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    variants = {"int16 for <= 4 rows (before)": 4, "int16 everywhere (now)": ops.DEFAULT_INT_ROWS}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    load = os.getloadavg()[0]
    for _ in range(rounds):
        for name, rows in variants.items():
            for m in modules:
                m.int_rows = rows
            model.fused_step = llama_decode.plan_for(model)
            start, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[name].append((time.perf_counter() - start, time.process_time() - cpu))
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 128 * requests
    print(
        f"\n{requests} requests x 128 prompt + 128 new tokens, {torch.get_num_threads()} thread(s), whole runs "
        f"alternating, "
        f"load average before {load:.1f}, after {os.getloadavg()[0]:.1f}:\n"
    )
    print("| variant | runs | best wall s | tok/s (best wall) | best CPU s | tok per CPU s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        wall, cpu = min(w for w, _ in r), min(c for _, c in r)
        print(
            f"| {name} | {len(r)} | {wall:.2f} | {128 * requests / wall:.1f} | {cpu:.2f} | {128 * requests / cpu:.1f} |"
        )


def engine_steps(requests: int, rounds: int, clock) -> None:
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.builtin.lowbit import llama_decode
    from deepinfer_core.lowbit import ops
    from deepinfer_core.lowbit.modules import LowBitEmbedding, LowBitLinear

    llm = LLM(
        "smollm2-135m-instruct",
        device="cpu",
        max_num_seqs=max(16, requests),
        kv_cache_blocks=4 * max(16, requests) + 8,
        enable_prefix_caching=False,
    )
    engine, model = llm.engine, llm.engine.model
    modules = [m for m in model.modules() if isinstance(m, (LowBitLinear, LowBitEmbedding))]
    text = llm.get_tokenizer().encode("It was the best of times, it was the worst of times, " * 40)
    variants = {
        "float32 activations": 0,
        "int16 for <= 4 rows (before)": 4,
        "int16 everywhere (now)": ops.DEFAULT_INT_ROWS,
    }

    def use(rows: int) -> None:
        for m in modules:
            m.int_rows, m.int8_rows = rows, 0
        model.fused_step = llama_decode.plan_for(model)

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    engine.add_request(text[:16], SamplingParams(max_tokens=2))
    drain()  # first forward: plan, build
    prefill = {name: float("inf") for name in variants}
    decode = {name: float("inf") for name in variants}
    for r in range(rounds):
        for name, rows in variants.items():
            use(rows)
            for i in range(16):
                engine.add_request(text[i + r : i + r + 128], SamplingParams(max_tokens=1, ignore_eos=True))
            start = clock()
            engine.step()  # the 2,048 prompt tokens in one step
            prefill[name] = min(prefill[name], clock() - start)
            drain()
        ids = [
            engine.add_request(text[i + r : i + r + 128], SamplingParams(max_tokens=64, ignore_eos=True))
            for i in range(requests)
        ]
        for _ in range(-(-requests * 128 // engine.config.max_num_batched_tokens) + 2):
            engine.step()  # prefill of the decode requests, then two decode steps
        for name, rows in variants.items():
            use(rows)
            engine.step()  # the new plan's first step
            for _ in range(3):
                start = clock()
                engine.step()
                decode[name] = min(decode[name], clock() - start)
        for i in ids:
            engine.abort_request(i)
        drain()
    base = prefill["float32 activations"], decode["float32 activations"]
    print(f"\nSmolLM2 Q4_1, default engine, best of {rounds} rounds (variants alternating), CPU ms per step:\n")
    print(f"| variant | prefill step, 16 x 128 tokens | vs float32 | decode step, {requests} requests | vs float32 |")
    print("|---|---:|---:|---:|---:|")
    for name in variants:
        print(
            f"| {name} | {prefill[name] * 1e3:.0f} | {base[0] / prefill[name]:.2f}x | {decode[name] * 1e3:.1f} | "
            f"{base[1] / decode[name]:.2f}x |"
        )


if __name__ == "__main__":
    main()

"""The one-call decode step's thread count under a background load: torch's fixed count vs the
adaptive choice (lowbit/threads.py), idle and with busy processes, in one run.

    .venv/bin/python benchmarks/decode_threads.py --requests 32 --threads 2 --busy 1 --steps 48

SmolLM2's default (low-bit) engine, ``--requests`` 128-token prompts prefilled, then decode steps
in alternating blocks of ``--steps``: fixed (``--threads`` for every native call) and adaptive
(the plan's ThreadChooser, one instance kept across its blocks, probing every ``--probe-every``
steps). Then the same with ``--busy`` processes spinning on the CPU (started by this script).
Prints the median and mean wall ms per decode step of each (load, mode) and fixed / adaptive.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch


def spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--busy", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--probe-every", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.lowbit.threads import ThreadChooser

    R, total = args.requests, 2 * 2 * args.blocks * args.steps + 8
    llm = LLM(
        "smollm2-135m-instruct", device="cpu", max_num_seqs=R, kv_cache_blocks=R * (-(-(128 + total + 8) // 16)) + 2
    )
    vocab = llm.get_tokenizer().encode("It was the best of times, it was the worst of times, " * 20)
    engine, model = llm.engine, llm.engine.model
    for r in range(R):
        engine.add_request(vocab[r : r + 128], SamplingParams(temperature=0, max_tokens=total + 4, ignore_eos=True))
    for _ in range(-(-R * 128 // engine.config.max_num_batched_tokens) + 2):
        engine.step()
    plan = model._decode_plan
    assert plan is not None, "no one-call decode plan (DEEPINFER_FUSED_DECODE=0?)"
    print(f"{R} requests, {args.threads} threads, {os.cpu_count()} CPUs, load average before {os.getloadavg()[0]:.1f}, "
          f"probe every {args.probe_every} steps")  # fmt: skip
    print(
        "| load | mode | median ms / step | mean ms / step | fixed / adaptive (mean) |\n|---|---|---:|---:|---:|",
        flush=True,
    )
    results: dict[tuple[str, str], list[float]] = {}
    for load in ("idle", f"{args.busy} busy"):
        busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy if load != "idle" else 0)]
        for p in busy:
            p.start()
        chooser = ThreadChooser(probe_every=args.probe_every)
        try:
            for _ in range(args.blocks):
                for mode in ("fixed", "adaptive"):
                    plan.threads = chooser if mode == "adaptive" else None
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        engine.step()
                        results.setdefault((load, mode), []).append((time.perf_counter() - t0) * 1e3)
        finally:
            for p in busy:
                p.kill()
        fixed = statistics.mean(results[(load, "fixed")])
        for mode in ("fixed", "adaptive"):
            xs = results[(load, mode)]
            print(
                f"| {load} | {mode} | {statistics.median(xs):.1f} | {statistics.mean(xs):.1f} | {fixed / statistics.mean(xs):.2f}x |",
                flush=True,
            )
        print(
            f"({load}: adaptive ended on {chooser.current} thread(s) after {chooser.switches} switch(es); load average now {os.getloadavg()[0]:.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()

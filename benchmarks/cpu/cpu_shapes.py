"""deepinfer's default vs llama.cpp on shapes other than cpu_throughput.py's, in CPU seconds on one thread.

    .venv/bin/python benchmarks/cpu/cpu_shapes.py 2:128:65 16:512:1 16:16-1500:9 32:128:17:Q8_0

Each SHAPE is ``requests:prompt tokens:new tokens[:GGUF]``: prompt tokens ``LOW-HIGH`` gives
mixed lengths, GGUF another file of the same weights (Q8_0, Q4_K_M, ...; see cpu_throughput.py's
``--gguf``). Both engines are loaded in this one process, sized for the shape as in
cpu_throughput.py (the same loaders and prompts); each round runs deepinfer then llama.cpp on
the same fresh prompts (rotated per round, so no prefix cache helps) and the best of the rounds
counts. The clock is ``time.process_time``: with one thread there is no OpenMP barrier to spin
at, so CPU seconds count an engine's work even when other jobs share the machine, where
wall-clock tok/s on two threads mostly measures how each engine copes with the load (llama.cpp's
two threads wait at every barrier for a descheduled one; deepinfer picks its thread count by
measured step time, lowbit/threads.py). It says nothing about two threads on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import cpu_throughput as ct  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", metavar="SHAPE")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for spec in args.shapes:
        n, plen, new, *gguf = spec.split(":")
        n, new = int(n), int(new)
        if gguf:
            os.environ["DEEPINFER_BENCH_GGUF"] = ct.make_gguf(gguf[0])
        else:
            os.environ.pop("DEEPINFER_BENCH_GGUF", None)
        prompts = ct.build_prompts(n, ct.prompt_lengths(n, plen))
        engines = {e: ct.LOADERS[e](prompts, new, 1) for e in ("deepinfer", "llamacpp")}
        for generate in engines.values():
            generate([p[::-1] for p in prompts], 2)  # warm-up on other prompts of the shape
        cpu = {e: float("inf") for e in engines}
        outputs = {}
        for r in range(args.rounds):
            rotated = [p[r + 1 :] + p[: r + 1] for p in prompts]
            for e, generate in engines.items():
                start = time.process_time()
                outputs[e] = generate(rotated, new)
                cpu[e] = min(cpu[e], time.process_time() - start)
        same = sum(a == b for a, b in zip(outputs["deepinfer"], outputs["llamacpp"]))
        rows.append((spec, cpu["deepinfer"], cpu["llamacpp"], same, n, os.getloadavg()[0]))
        print(f"done: {spec}", file=sys.stderr, flush=True)
    print(
        f"SmolLM2-135M-Instruct, 1 thread, CPU seconds of one generate() per engine (prefill included), best of "
        f"{args.rounds}; "
        f"deepinfer at {ct.revision()}\n"
    )
    print(
        "| requests:prompt:new[:file] | deepinfer CPU s | llama.cpp CPU s | llama.cpp / deepinfer | requests identical "
        "| load |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for spec, ours, theirs, same, n, load in rows:
        print(f"| {spec} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x | {same}/{n} | {load:.1f} |")


if __name__ == "__main__":
    main()

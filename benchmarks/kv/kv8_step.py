"""The whole 32-request decode step with a float16 vs an int8 KV cache, in one process.

    .venv/bin/python benchmarks/kv/kv8_step.py --requests 32 --steps 48 --threads 2

Two engines on SmolLM2's Q4_1 GGUF (the default path; ``kv_cache_dtype`` float16 and int8) each
prefill the same ``--requests`` 128-token prompts, then their decode steps alternate, one step of
one engine, one of the other, so that both see the same machine load. Per step: the process's CPU
ms for ``engine.step()`` and layer.c's phases (GEMMs / attention = rotary + KV write + decode
attention / the rest). Medians; contexts grow from 129 to 128 + steps tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu"))
    from cpu_throughput import build_prompts, start_decoding

    from deepinfer_core import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    prompts = build_prompts(args.requests, 128)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
    engines = {}
    for name in ("float16", "int8"):
        llm = LLM(
            "smollm2-135m-instruct",
            device="cpu",
            kv_cache_dtype=name,
            max_num_seqs=args.requests,
            kv_cache_blocks=2 * args.requests + 2,
        )
        engines[name] = start_decoding(llm, prompts, params, name)
    cpu, phases = {n: [] for n in engines}, {n: [] for n in engines}
    for _ in range(args.steps):
        for name, engine in engines.items():
            plan = engine.model.fused_step
            plan.phase_ms = torch.zeros(3, dtype=torch.float64)
            t0 = time.process_time()
            engine.step()
            cpu[name].append((time.process_time() - t0) * 1e3)
            phases[name].append(plan.phase_ms.tolist())
    print(
        f"{args.requests} requests, {args.threads} threads, {args.steps} decode steps each, alternating; load average "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    print("| KV cache | step CPU ms (median) | GEMMs / attention / rest CPU ms (median) |\n|---|---:|---:|")
    for name in engines:
        med = [statistics.median(p[i] for p in phases[name]) for i in range(3)]
        print(f"| {name} | {statistics.median(cpu[name]):.1f} | {med[0]:.1f} / {med[1]:.1f} / {med[2]:.1f} |")
    a = statistics.median(p[1] for p in phases["float16"]) / statistics.median(p[1] for p in phases["int8"])
    print(
        f"\nattention phase float16 / int8: {a:.2f}x; step: "
        f"{statistics.median(cpu['float16']) / statistics.median(cpu['int8']):.2f}x"
    )


if __name__ == "__main__":
    main()

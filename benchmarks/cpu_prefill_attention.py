"""The native prefill's attention, side by side in one process: the decode kernel a query at a time
(``DEEPINFER_PREFILL_ATTENTION=0``), ``prefill_attention.c`` reading every key from the cache (1),
and it with the call's own keys and values in float32 (2, the default).

    .venv/bin/python benchmarks/cpu_prefill_attention.py --requests 32 --threads 1 --rounds 3

Each round prefills ``--requests`` prompts of 128 tokens (``cpu_throughput.py``'s, no prefix
cache, one new token each) once per mode, the modes alternating on one engine so that all see the
same machine load. Per mode: the best round's process CPU seconds and wall seconds, and the
native call's own CPU split (``LlamaDecodePlan.phase_ms``: GEMMs, attention incl. rotary and the
KV write, the rest); speed-up of each against mode 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cpu_throughput import build_prompts  # noqa: E402

MODES = {0: "decode kernel, a query at a time (before)", 1: "prefill_attention.c, keys and values from the cache",
         2: "prefill_attention.c, the call's own in float32 (default)"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    args = parser.parse_args()
    from deepinfer_core import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    prompts = build_prompts(args.requests, args.prompt_tokens)
    blocks = args.requests * -(-(args.prompt_tokens + 8) // 128) + 2
    llm = LLM(
        "smollm2-135m-instruct",
        device="cpu",
        max_num_seqs=args.requests,
        kv_cache_blocks=blocks,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([p[::-1] for p in prompts], params, use_tqdm=False)  # warm-up; builds the plan
    plan = llm.engine.model._decode_plan
    if plan is None:
        raise SystemExit("no native plan on this machine (the low-bit kernels did not build)")
    best: dict[int, tuple[float, float, list[float]]] = {}
    firsts: dict[int, list[int]] = {}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for mode in args.modes:
            plan.prefill_attention = mode
            plan.phase_ms = torch.zeros(3, dtype=torch.float64)
            start, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            firsts[mode] = [o.outputs[0].token_ids[0] for o in outs]
            if mode not in best or cpu < best[mode][0]:
                best[mode] = (cpu, wall, (plan.phase_ms / 1e3).tolist())
    plan.phase_ms = None
    print(
        f"{args.requests} x {args.prompt_tokens}-token prompts prefilled, {args.threads} thread(s), best of {args.rounds} "
        f"(modes alternating), load average {load:.1f} -> {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| mode | prefill CPU s | wall s | native GEMMs CPU s | native attention CPU s | native rest CPU s | CPU vs mode 0 | attention vs mode 0 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = best.get(args.modes[0])
    for mode in args.modes:
        cpu, wall, (gemm, attn, rest) = best[mode]
        print(
            f"| {mode}: {MODES[mode]} | {cpu:.2f} | {wall:.2f} | {gemm:.2f} | {attn:.2f} | {rest:.2f} | "
            f"{base[0] / cpu:.2f}x | {base[2][1] / attn:.2f}x |"
        )
    same = sum(a == b for a, b in zip(firsts[args.modes[0]], firsts[args.modes[-1]]))
    print(f"\nfirst tokens equal between mode {args.modes[0]} and mode {args.modes[-1]}: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()

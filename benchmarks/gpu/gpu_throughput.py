"""deepinfer with the cuda_sm100 plugin vs transformers on one NVIDIA GPU, side by side.

    python benchmarks/gpu/gpu_throughput.py --model v3mini            # random DeepSeek-V3-mini, bf16
    python benchmarks/gpu/gpu_throughput.py --model smollm2           # SmolLM2-135M real weights (GGUF)
    python benchmarks/gpu/gpu_throughput.py --model v3mini-fp8 --skip hf   # V3-mini in DeepSeek's FP8 block format
    python benchmarks/gpu/gpu_throughput.py --model v4mini --skip hf,accept --levels 1,16,64   # random DeepSeek-V4-mini
    python benchmarks/gpu/gpu_throughput.py --model v4mini --skip hf,accept --levels 1,16,64 --graphs-off
    # (+ eager decode in the same engine)

For each model, in one process (each engine measured after the other was freed):

* acceptance checks: float32 greedy tokens of the plugin's kernels == the builtin reference path
  (``attention_backend="builtin", moe_backend="builtin"``), 8 prompts x 64 tokens; bf16 greedy
  agreement with transformers' float32 tokens, per prompt, next to transformers' own bf16;
  batch-invariant mode: a request alone == the same request inside a batch of 64;
* decode ms/step at 1/16/64/256 concurrent requests (128-token prompts): time of
  ``1 + steps`` new tokens minus time of 1 new token, over ``steps``;
* prefill tok/s: 64 prompts x 512 tokens, one new token each;
* the weight-read floor of a decode step (bytes of the weights a step must read, over the copy
  bandwidth measured in the same run) and each engine's ratio to it; peak GPU memory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time

import torch

from deepinfer_core import LLM, SamplingParams

V3_MINI = dict(
    vocab_size=129280, hidden_size=2048, intermediate_size=9216, moe_intermediate_size=1024,
    num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, n_shared_experts=1,
    routed_scaling_factor=2.5, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
)  # fmt: skip
# DeepSeek-V4's layout at V3-mini's scale (released-name bf16 checkpoint, every layer kind:
# sliding, CSA (rate 4, indexer top-512), HCA (rate 128); 2 hash-routed layers; hyper-connections).
V4_MINI = dict(
    vocab_size=129280, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=1,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=4, o_lora_rank=512,
    n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=1024, num_hash_layers=2,
    compress_ratios=[0, 4, 128, 4, 128, 4, 128, 0, 0], compress_rate_hca=128, sliding_window=128,
    index_n_heads=16, index_head_dim=128, index_topk=512, max_position_embeddings=4096,
)  # fmt: skip
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Give me a tip for learning to code.",
]  # fmt: skip


def log(*a):
    print(*a, flush=True)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (median of 10)."""
    a = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    t = sorted(times[2:])[len(times[2:]) // 2]
    del a, b
    return 2 * 2**30 / t


# -- models ------------------------------------------------------------------------------------
def make_v3mini(folder: str) -> None:
    import transformers

    cfg = transformers.DeepseekV3Config(**V3_MINI)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model


def make_v4mini(folder: str) -> None:
    from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint

    write_tiny_v4_checkpoint(folder, weights="bf16", experts="bf16", config=dict(TINY_V4_CONFIG) | V4_MINI, shards=1)


def make_v4mini_fp8(folder: str) -> None:
    """V4-mini as DeepSeek ships V4: projections FP8 e4m3 with 128 x 128 UE8M0 scales, routed
    experts MXFP4 (two values a byte, one UE8M0 scale per 32)."""
    from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint

    write_tiny_v4_checkpoint(folder, weights="fp8", experts="fp4", config=dict(TINY_V4_CONFIG) | V4_MINI, shards=1)


def checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def file_bytes_per_step(folder: str, n: int, experts: int, top_k: int) -> float:
    """Bytes of a checkpoint's tensors one decode step over ``n`` requests must read, as stored
    (FP8 / MXFP4 bytes and their scales for a quantized file): every tensor once except the
    embedding (its rows only), integer tables (looked up) and the MTP layers (no drafting here);
    each routed expert's tensors scaled by the experts n tokens are expected to touch (uniform
    routing: E * (1 - (1 - k/E)^n), over E)."""
    import json
    import struct

    size = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1}
    touched = 1 - (1 - top_k / experts) ** n
    total = 0.0
    for f in os.listdir(folder):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, f), "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, meta in header.items():
            if name == "__metadata__" or name.startswith(("embed.", "mtp.")) or meta["dtype"] not in size:
                continue
            b = size[meta["dtype"]] * float(torch.tensor(meta["shape"]).prod())
            total += b * touched if ".ffn.experts." in name else b
    return total


def make_fp8(folder: str, device: str = "cuda") -> None:
    """Rewrite the checkpoint in ``folder`` as DeepSeek ships V3: every projection (attention,
    dense MLP, shared and routed experts, per-expert layout) FP8 e4m3 + ``weight_scale_inv``;
    embeddings, norms, router and head as they were (deepinfer_core.testing.v3_checkpoint)."""
    from deepinfer_core.testing.v3_checkpoint import rewrite_as_fp8_blocks

    rewrite_as_fp8_blocks(folder, device=device)


def load_hf(path: str, dtype):
    import transformers

    folder, name = os.path.split(path)
    kw = {"gguf_file": name} if name.endswith(".gguf") else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder if kw else path, dtype=dtype, **kw).cuda().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts_for(args, path) -> list[list[int]]:
    if args.model == "smollm2":
        from transformers import AutoTokenizer

        folder, name = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for q in QUESTIONS
        ]
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(2, V3_MINI["vocab_size"], (n,), generator=g).tolist() for n in (5, 17, 33, 60, 90, 128, 150, 200)
    ]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


# -- engines -----------------------------------------------------------------------------------
def di(path, dtype, **kw) -> LLM:
    kw.setdefault("enable_prefix_caching", False)
    return LLM(path, device="cuda", dtype=dtype, **kw)


def di_before(path, dtype, **kw) -> LLM:
    """An engine as before the LM head and argmax were captured in the decode graphs and the
    head's logits were kept float32: head eager after the replay, logits rounded to bf16."""
    from deepinfer_cuda_sm100 import graphs

    saved, graphs.HEAD_ROWS = graphs.HEAD_ROWS, 0
    try:
        llm = di(path, dtype, **kw)
    finally:
        graphs.HEAD_ROWS = saved
    for m in llm.engine.model.modules():
        if "logits_kernel" in type(m).__dict__:
            m.logits_kernel = None
    return llm


def di_greedy(llm: LLM, prompts, new) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def hf_greedy(model, prompts, new) -> list[list[int]]:
    res = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        res.append(out[0, len(p) :].tolist())
    return res


@torch.inference_mode()
def hf_forced(model, prompts, paths) -> list[tuple[list[int], list[float]]]:
    """Teacher forcing along each prompt's float32 greedy path: per position the argmax and the
    top-2 logit margin (one forward per prompt)."""
    res = []
    for p, c in zip(prompts, paths):
        ids = torch.tensor([p + c[:-1]], device="cuda")
        top = model(ids).logits[0, len(p) - 1 :].float().topk(2, dim=-1)
        res.append((top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()))
    return res


def di_forced(llm: LLM, prompts, paths) -> list[list[int]]:
    """deepinfer's greedy next token after every prefix of each float32 greedy path (one
    1-token request per prefix, all in one generate call)."""
    flat = [p + c[:j] for p, c in zip(prompts, paths) for j in range(len(c))]
    it = iter(o[0] for o in di_greedy(llm, flat, 1))
    return [[next(it) for _ in c] for c in paths]


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def di_speed(llm: LLM, vocab: int, levels, steps: int, prompt_len: int) -> dict:
    res = {}
    di_greedy(llm, random_prompts(2, prompt_len, vocab, 1), 4)  # warm-up
    for n in levels:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0, max_tokens=1 + steps, ignore_eos=True)
        llm.generate(random_prompts(n, prompt_len, vocab, 10 + n), many)  # warm this batch size
        t1 = timed(lambda: llm.generate(random_prompts(n, prompt_len, vocab, 20 + n), one))
        t2 = timed(lambda: llm.generate(random_prompts(n, prompt_len, vocab, 30 + n), many))
        res[n] = 1e3 * (t2 - t1) / steps
        log(f"  deepinfer decode N={n}: {res[n]:.2f} ms/step")
    return res


def di_prefill(llm: LLM, vocab: int, runs: int = 1) -> float:
    """tok/s of the fastest of ``runs`` timed 64 x 512 prefills (each reading is logged when
    there are several: a disturbed one shows as a spread). The prompts are drawn before the
    clock starts, as :func:`hf_prefill` draws the peer's (drawing 32,768 random ids as lists
    is ~1 ms of the benchmark's own host time, no work of the engine's)."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(random_prompts(64, 512, vocab, 40), one)
    batches = [random_prompts(64, 512, vocab, 41 + 100 * r) for r in range(runs)]
    times = [timed(lambda: llm.generate(batch, one)) for batch in batches]
    if runs > 1:
        log(
            f"  deepinfer prefill readings: {', '.join(f'{64 * 512 / t:,.0f}' for t in times)} tok/s (median "
            f"{64 * 512 / sorted(times)[runs // 2]:,.0f})"
        )
    return 64 * 512 / min(times)


def prefill_timeline(llm: LLM, vocab: int) -> None:
    """Where the wall time of one 64 x 512 prefill goes on the GPU's timeline (torch profiler,
    CPU and CUDA activities, one clock): host time before the first kernel, GPU idle gaps
    between kernels (the largest with the kernels around them), host time after the last."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = random_prompts(64, 512, vocab, 78)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("prefill_generate"):
            llm.generate(prompts, one)
            torch.cuda.synchronize()
    events = prof.events()
    outer = next(ev for ev in events if ev.name == "prefill_generate")
    kernels = sorted(
        ((ev.time_range.start, ev.time_range.end, ev.name) for ev in events if ev.device_type == DeviceType.CUDA),
        key=lambda k: k[0],
    )
    if not kernels:
        return
    gaps, busy, end = [], 0.0, kernels[0][0]
    prev = kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, prev, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    wall = outer.time_range.end - outer.time_range.start
    before, after = kernels[0][0] - outer.time_range.start, outer.time_range.end - end
    idle = sum(g for g, _, _ in gaps)
    log(
        f"PROFILE prefill timeline: wall {wall / 1e3:.2f} ms = host before the first kernel {before / 1e3:.2f} + GPU "
        f"busy {busy / 1e3:.2f} + idle between kernels {idle / 1e3:.2f} ({len(gaps)} gaps, "
        f"{sum(g > 20 for g, _, _ in gaps)} over 20 us) + after the last kernel {after / 1e3:.2f}; {len(kernels)} "
        f"kernels and copies"
    )
    for g, a, b in sorted(gaps, reverse=True)[:10]:
        log(f"    gap {g / 1e3:6.3f} ms  after {a[:50]}  before {b[:50]}")


@torch.inference_mode()
def hf_speed(model, vocab: int, levels, steps: int, prompt_len: int) -> dict:
    res = {}
    for n in levels:

        def run(new, seed):
            ids = torch.tensor(random_prompts(n, prompt_len, vocab, seed), device="cuda")
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )

        run(2, 50 + n)
        t1 = timed(lambda: run(1, 60 + n))
        t2 = timed(lambda: run(1 + steps, 70 + n))
        res[n] = 1e3 * (t2 - t1) / steps
        log(f"  transformers decode N={n}: {res[n]:.2f} ms/step")
    return res


@torch.inference_mode()
def hf_prefill(model, vocab: int) -> float:
    ids = torch.tensor(random_prompts(64, 512, vocab, 40), device="cuda")
    model(ids, use_cache=False)
    ids = torch.tensor(random_prompts(64, 512, vocab, 41), device="cuda")
    return 64 * 512 / timed(lambda: model(ids, use_cache=False, logits_to_keep=1))


def free() -> None:
    """Release GPU memory of engines the caller has already deleted (``del x; free()``: a
    function cannot drop its caller's reference)."""
    gc.collect()
    torch.cuda.empty_cache()


def peak_mib() -> float:
    return torch.cuda.max_memory_allocated() / 2**20


def replay_ms(g: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    """GPU time of one replay of a captured graph (CUDA events around ``reps`` replays, after one)."""
    g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def kernel_table(run, reps: int = 20) -> list[tuple[str, float, float]]:
    """Every GPU kernel ``run()`` launches (a graph's ``replay``, a prefill): (name, ms per run,
    launches per run), largest first (torch profiler over ``reps`` runs). Also used by
    decode_kernels.py."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    rows = [(ev.key, getattr(ev, key) / reps / 1e3, ev.count / reps) for ev in events if getattr(ev, key) > 0]
    return sorted(rows, key=lambda r: -r[1])


def profile(llm: LLM, vocab: int, decode_ms: dict) -> None:
    """Measured bounds: GPU time of the captured decode graph alone (the rest of a step is host
    work: scheduling, batch building, sampling, output processing), and the top GPU kernels of
    one 64 x 512 prefill step."""
    graphs = llm.engine.runner.graphs
    if getattr(graphs, "v4", None) is not None:  # DeepSeek-V4: its own graphs (v4_graphs.py)
        graphs = graphs.v4
    for n in sorted(decode_ms):
        g = graphs.graphs.get(n) if graphs is not None else None
        if g is None:
            continue
        gpu = replay_ms(g)
        log(
            f"PROFILE decode N={n}: graph replay {gpu:.2f} ms on the GPU of {decode_ms[n]:.2f} ms per step; host and "
            f"the rest {decode_ms[n] - gpu:.2f} ms"
        )
    for n in (1, 64):  # what a replayed step's GPU time is made of (kernels inside the graph)
        g = graphs.graphs.get(n) if graphs is not None else None
        if g is None:
            continue
        rows = kernel_table(g.replay)
        log(
            f"PROFILE decode N={n} graph: {sum(r[2] for r in rows):.0f} kernels, {sum(r[1] for r in rows):.2f} ms of "
            f"kernel time per step; top:"
        )
        for name, ms, launches in rows[:60]:  # every kind of kernel a step launches
            log(f"  {ms:7.3f} ms  {launches:5.0f}x  {name[:110]}")
    import cProfile
    import io
    import pstats

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = random_prompts(64, 512, vocab, 76)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, one)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    log(
        "PROFILE prefill 64 x 512, host (cProfile, own time per function; waits on the GPU show as synchronising "
        "calls):"
    )
    log("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:4000])

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = random_prompts(64, 512, vocab, 77)
    rows = kernel_table(lambda: llm.generate(prompts, one), reps=1)
    log(
        f"PROFILE prefill 64 x 512: GPU kernel time {sum(r[1] for r in rows):.1f} ms, {sum(r[2] for r in rows):.0f} "
        f"kernels; top kernels:"
    )
    for name, ms, launches in rows[:16]:
        log(f"  {ms:8.2f} ms  {launches:5.0f}x  {name[:90]}")
    prefill_timeline(llm, vocab)


# -- floor -------------------------------------------------------------------------------------
def weight_bytes_per_step(config: dict, n: int, elem: int = 2) -> float:
    """Bytes of weights one decode step over ``n`` requests must read: every dense weight once
    (embedding rows aside), and per MoE layer the experts that n tokens are expected to touch
    (uniform routing: E * (1 - (1 - k/E)^n)). An FP8 checkpoint: projections 1 byte (kv_b_proj,
    kept bf16 for MLA's absorption, 2), the head 2 bytes; tile scales are 1/16384 of that."""
    if (config.get("quantization_config") or {}).get("quant_method") == "fp8":
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        D, V, L, H = (
            config["hidden_size"],
            config["vocab_size"],
            config["num_hidden_layers"],
            config["num_attention_heads"],
        )
        kv_b = L * config["kv_lora_rank"] * H * (config["qk_nope_head_dim"] + config["v_head_dim"])
        return weight_bytes_per_step(plain, n, 1) + V * D + kv_b
    D, V = config["hidden_size"], config["vocab_size"]
    L = config["num_hidden_layers"]
    if "kv_lora_rank" not in config:  # Llama
        H, Hkv, I = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
        hd = D // H
        per_layer = D * (H + 2 * Hkv) * hd + H * hd * D + 3 * D * I
        return elem * (L * per_layer + V * D)
    H = config["num_attention_heads"]
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    attn = (
        D * config["q_lora_rank"]
        + config["q_lora_rank"] * H * qk
        + D * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    )
    attn += (
        config["kv_lora_rank"] * H * (config["qk_nope_head_dim"] + config["v_head_dim"]) + H * config["v_head_dim"] * D
    )
    E, k, I = config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
    dense_layers = config["first_k_dense_replace"]
    moe_layers = L - dense_layers
    touched = E * (1 - (1 - k / E) ** n)
    total = L * attn + dense_layers * 3 * D * config["intermediate_size"]
    total += moe_layers * (touched * 3 * D * I + config["n_shared_experts"] * 3 * D * I + E * D)
    return elem * (total + V * D)


# -- main --------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["v3mini", "v3mini-fp8", "v4mini", "v4mini-fp8", "smollm2"], default="v3mini")
    ap.add_argument("--path", default=None, help="model path (smollm2: the GGUF; default: the installed alias)")
    ap.add_argument("--levels", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="tokens per acceptance prompt")
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of: accept,speed,hf,hfaccept,serial (serial: the overlap-off re-measure; hfaccept: the "
        "agreement with transformers, keeping its speed)",
    )
    ap.add_argument(
        "--ab",
        action="store_true",
        help="also time (decode, levels <= 64) and check (bf16 agreement) an engine as before the LM head moved into "
        "the graph: head eager, bf16 logits; alternated with the default",
    )
    ap.add_argument(
        "--ab-fold",
        action="store_true",
        help="DeepSeek-V4: also time decode (levels <= 64) on an engine as before 2026-12-07's launch cuts (the MoE "
        "layers' clamped shared expert as its own MLP, the hyper-connections' input as torch ops + hc_mix instead of "
        "hc_pre), alternated with the default",
    )
    ap.add_argument(
        "--prefill-runs",
        type=int,
        default=1,
        help="timed 64 x 512 prefills per measure (the fastest is the figure; every reading is logged)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure decode and prefill this many times in the same engine (a disturbed reading shows as a spread)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="also say where prefill and decode time goes")
    ap.add_argument(
        "--graphs-off",
        action="store_true",
        help="also time decode on the same engine with its CUDA graphs set aside (eager steps)",
    )
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    levels = [int(x) for x in args.levels.split(",")]
    bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s (read+write)")

    tmp = None
    if args.model.startswith("v3mini"):
        tmp = tempfile.mkdtemp(prefix="v3mini")
        t = time.perf_counter()
        make_v3mini(tmp)
        config = dict(V3_MINI)
        if args.model == "v3mini-fp8":
            make_fp8(tmp)
            config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        log(f"{args.model} random checkpoint written in {time.perf_counter() - t:.0f}s")
        path = tmp
    elif args.model.startswith("v4mini"):
        tmp = tempfile.mkdtemp(prefix="v4mini")
        t = time.perf_counter()
        (make_v4mini_fp8 if args.model == "v4mini-fp8" else make_v4mini)(tmp)
        log(f"v4mini random checkpoint written in {time.perf_counter() - t:.0f}s")
        path, config = tmp, V4_MINI
    else:
        from deepinfer_core.engine.loading import resolve_model_path
        from deepinfer_core.plugin_host import default_host

        path = args.path or resolve_model_path("smollm2-135m-instruct", default_host())
        config = None
    prompts = prompts_for(args, path)
    report: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "copy_bw": bw}

    if "accept" not in skip:
        ref = di(
            path, "float32", attention_backend="builtin", moe_backend="builtin", fused_ops=False, kv_cache_blocks=64
        )
        ref_tokens = di_greedy(ref, prompts, args.new)
        del ref
        free()
        ours = di(path, "float32", kv_cache_blocks=64)
        log(
            "fp32 kernels:",
            sorted(
                {type(m.backend).__name__ for m in ours.engine.model.modules() if hasattr(m, "backend")}
                | {type(m.dispatcher).__name__ for m in ours.engine.model.modules() if hasattr(m, "dispatcher")}
            ),
        )
        our_tokens = di_greedy(ours, prompts, args.new)
        del ours
        free()
        same = [a == b for a, b in zip(our_tokens, ref_tokens)]
        first_diff = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(our_tokens, ref_tokens)
        ]
        log(
            f"ACCEPT fp32 plugin == builtin reference: {sum(same)}/{len(same)} prompts identical; common prefix "
            f"{first_diff}"
        )
        report["fp32_identical"] = [sum(same), len(same), first_diff]

        bf = di(path, "bfloat16", kv_cache_blocks=64, overlap_debug=True)
        bf_tokens = di_greedy(bf, prompts, args.new)
        del bf
        free()
        serial = di(path, "bfloat16", kv_cache_blocks=64, overlap_scheduling=False)
        serial_tokens = di_greedy(serial, prompts, args.new)
        del serial
        free()
        same = sum(a == b for a, b in zip(bf_tokens, serial_tokens))
        log(
            f"ACCEPT overlapped scheduling (debug guard on) == serial steps, bf16 greedy: {same}/{len(prompts)} "
            f"prompts identical"
        )
        report["overlap_identical"] = [same, len(prompts)]
        inv = di(path, "bfloat16", kv_cache_blocks=256, batch_invariant=True, max_num_seqs=64)
        vocab = (config or {}).get("vocab_size", 49152)
        batch = random_prompts(63, 40, vocab, 99)
        alone = di_greedy(inv, [prompts[1]], 32)[0]
        together = di_greedy(inv, batch[:31] + [prompts[1]] + batch[31:], 32)[31]
        del inv
        free()
        log(f"ACCEPT batch-invariant bf16: alone == in a batch of 64: {alone == together}")
        report["batch_invariant"] = alone == together
        if "hf" not in skip and "hfaccept" not in skip:
            hf32 = load_hf(path, torch.float32)
            hf32_tokens = hf_greedy(hf32, prompts, args.new)
            del hf32
            free()
            hf16 = load_hf(path, torch.bfloat16)
            hf16_tokens = hf_greedy(hf16, prompts, args.new)
            del hf16
            free()

            def prefix(a, b):
                return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

            rows = [(prefix(o, h), prefix(t, h)) for o, t, h in zip(bf_tokens, hf16_tokens, hf32_tokens)]
            old_rows = None
            if args.ab:
                old = di_before(path, "bfloat16", kv_cache_blocks=64)
                old_rows = [prefix(o, h) for o, h in zip(di_greedy(old, prompts, args.new), hf32_tokens)]
                del old
                free()
            log("ACCEPT bf16 agreement with transformers fp32 (common prefix of %d tokens), per prompt:" % args.new)
            log(
                "| prompt | deepinfer bf16 | transformers bf16 |"
                + (
                    " deepinfer bf16 before (bf16 logits) |\n|---:|---:|---:|---:|"
                    if old_rows
                    else "\n|---:|---:|---:|"
                )
            )
            for i, (a, b) in enumerate(rows):
                log(f"| {i} | {a} | {b} |" + (f" {old_rows[i]} |" if old_rows else ""))
            log(
                f"| total | {sum(a for a, _ in rows)} | {sum(b for _, b in rows)} |"
                + (f" {sum(old_rows)} |" if old_rows else "")
            )
            report["bf16_agreement"] = rows
            report["bf16_agreement_before"] = old_rows
            ref32 = [prefix(r, h) for r, h in zip(ref_tokens, hf32_tokens)]
            log(f"(fp32 reference path vs transformers fp32, common prefix per prompt: {ref32})")
            # The free-running prefix above is chaotic (one near-tie decides it); teacher forcing
            # along the fp32 path counts every position: argmax == fp32's, per prompt.
            hf32 = load_hf(path, torch.float32)
            ref_forced = hf_forced(hf32, prompts, hf32_tokens)
            del hf32
            free()
            hf16 = load_hf(path, torch.bfloat16)
            hf16_forced = hf_forced(hf16, prompts, hf32_tokens)
            del hf16
            free()
            bf = di(path, "bfloat16", kv_cache_blocks=256, max_num_seqs=64)
            di16_forced = di_forced(bf, prompts, hf32_tokens)
            del bf
            free()
            old_forced = None
            if args.ab:
                old = di_before(path, "bfloat16", kv_cache_blocks=256, max_num_seqs=64)
                old_forced = di_forced(old, prompts, hf32_tokens)
                del old
                free()
            log(
                f"ACCEPT bf16 teacher-forced argmax == transformers fp32 argmax along the fp32 greedy path ({args.new} "
                f"positions a prompt); fp32 top-2 margin where each bf16 run first left the path:"
            )
            log(
                "| prompt | deepinfer bf16 | transformers bf16 | fp32 margin at deepinfer's divergence | at "
                "transformers bf16's |\n|---:|---:|---:|---:|---:|"
            )
            tot = [0, 0]
            for i, ((ref_ids, margin), (h_ids, _), d_ids) in enumerate(zip(ref_forced, hf16_forced, di16_forced)):
                a, b = sum(x == y for x, y in zip(d_ids, ref_ids)), sum(x == y for x, y in zip(h_ids, ref_ids))
                tot[0] += a
                tot[1] += b
                at = [f"{margin[r]:.3f}" if r < len(margin) else "-" for r in rows[i]]
                log(f"| {i} | {a} | {b} | {at[0]} | {at[1]} |")
            log(f"| total | {tot[0]} | {tot[1]} | | |")
            report["bf16_forced"] = tot
            if old_forced:
                per = [sum(x == y for x, y in zip(d, r)) for d, (r, _) in zip(old_forced, ref_forced)]
                log(
                    f"ACCEPT teacher-forced, deepinfer bf16 before (bf16 logits): {per} = {sum(per)} / "
                    f"{sum(len(c) for c in hf32_tokens)}"
                )
                report["bf16_forced_before"] = per

    if "speed" not in skip:
        vocab = (config or {}).get("vocab_size", 49152)
        torch.cuda.reset_peak_memory_stats()
        # 64 sequences at least: the prefill measure is one 64 x 512 step whatever the levels
        llm = di(
            path,
            "bfloat16",
            max_num_seqs=max(levels + [64]),
            max_num_batched_tokens=64 * 512,
            kv_cache_blocks=max(max(levels) * 2 + 300, 64 * 5 + 16),
        )
        cfg = llm.engine.model.config
        from deepinfer_core.engine.kv_sizing import cache_bytes

        # the memory measure: a loaded engine's peak (weights, KV cache, captured graphs,
        # start-up warm-ups) against the checkpoint file plus its KV cache
        load_peak = peak_mib()
        kv_mib = cache_bytes(llm.engine.runner.kv_caches) / 2**20
        held = {t.data_ptr(): t for t in list(llm.engine.model.parameters()) + list(llm.engine.model.buffers())}
        weights_mib = sum(t.numel() * t.element_size() for t in held.values()) / 2**20
        report.update(load_peak_mib=load_peak, kv_cache_mib=kv_mib, weights_held_mib=weights_mib)
        from deepinfer_core.models.fp8 import Fp8Experts, Fp8Linear
        from deepinfer_core.models.mxfp4 import Mxfp4Experts

        kept = sum(isinstance(m, (Fp8Linear, Fp8Experts)) for m in llm.engine.model.modules())
        packed = sum(isinstance(m, Mxfp4Experts) for m in llm.engine.model.modules())  # v4mini-fp8 with the plugin
        log(
            f"  modules holding FP8 weights: {kept}; MXFP4 expert stacks kept packed: {packed}; "
            f"fused kernels installed: {llm.engine.num_fused}"
        )
        report["mxfp4_expert_stacks"] = packed
        di_dec = di_speed(llm, vocab, levels, args.steps, 128)
        di_pre = di_prefill(llm, vocab, args.prefill_runs)
        for r in range(1, args.repeat):  # the same measures again: which reading is the real one
            log(f"  repeat {r + 1} of {args.repeat}:")
            again = di_speed(llm, vocab, levels, args.steps, 128)
            pre = di_prefill(llm, vocab, args.prefill_runs)
            log(f"  deepinfer prefill {pre:,.0f} tok/s (repeat {r + 1})")
            report.setdefault("di_repeats", []).append({"decode": again, "prefill": pre})
        di_peak = peak_mib()
        serial_dec = {}
        if "serial" not in skip and not llm.engine.overlap:  # e.g. a persistent KV store
            log("  overlapped scheduling is off in this engine: its decode steps above are serial, no second measure")
        elif "serial" not in skip:
            llm.engine.overlap = False  # the same engine with serial steps (host work between device steps)
            log("  deepinfer with overlapped scheduling off:")
            serial_dec = di_speed(llm, vocab, levels, args.steps, 128)
            llm.engine.overlap = True
        eager_dec = {}
        if args.graphs_off and llm.engine.runner.graphs is not None:
            graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None
            log("  deepinfer with CUDA graphs off (every decode step eager):")
            eager_dec = di_speed(llm, vocab, levels, args.steps, 128)
            llm.engine.runner.graphs = graphs
        if args.ab:  # alternate with the engine as before, both alive: after, before, after, before
            ab_levels = [n for n in levels if n <= 64]
            old = di_before(
                path,
                "bfloat16",
                max_num_seqs=max(levels),
                max_num_batched_tokens=64 * 512,
                kv_cache_blocks=max(levels) * 2 + 300,
            )
            ab = {"after": [], "before": []}
            for _ in range(2):
                for name, engine in (("after", llm), ("before", old)):
                    log(f"  A/B {name}:")
                    ab[name].append(di_speed(engine, vocab, ab_levels, args.steps, 128))
            del old
            free()
            log(
                "A/B decode ms/step (LM head + argmax in the graph, float32 logits = after; head eager, bf16 logits = "
                "before), two alternations:"
            )
            log("| requests | after | before | before / after |\n|---:|---|---|---:|")
            for n in ab_levels:
                a, b = [r[n] for r in ab["after"]], [r[n] for r in ab["before"]]
                log(f"| {n} | {a[0]:.3f}, {a[1]:.3f} | {b[0]:.3f}, {b[1]:.3f} | {min(b) / min(a):.3f}x |")
            report["ab"] = ab
        if args.ab_fold:
            report["ab_fold"] = ab_fold(llm, path, levels, vocab, args.steps)
        if args.profile:
            profile(llm, vocab, di_dec)
        del llm
        free()
        log(f"  deepinfer prefill {di_pre:,.0f} tok/s, peak {di_peak:.0f} MiB")
        hf_dec, hf_pre, hf_peak = {}, float("nan"), float("nan")
        if "hf" not in skip:
            torch.cuda.reset_peak_memory_stats()
            hf = load_hf(path, torch.bfloat16)
            hf_dec = hf_speed(hf, vocab, levels, args.steps, 128)
            hf_pre = hf_prefill(hf, vocab)
            hf_peak = peak_mib()
            del hf
            free()
            log(f"  transformers prefill {hf_pre:,.0f} tok/s, peak {hf_peak:.0f} MiB")
        log(
            f"\n{args.model} (activations bf16), 128-token prompts, decode = ({args.steps}+1 tokens - 1 token) / "
            f"{args.steps}; "
            f"floor = weight bytes per step / {bw / 1e12:.2f} TB/s (the copy's bytes read + written a second: what the "
            f"memory streams; half of it, the copy's read rate alone, was beaten at 16-64 requests)"
        )
        log(
            "| measure | transformers | deepinfer | deepinfer / transformers | floor | deepinfer / floor "
            "|\n|---|---:|---:|---:|---:|---:|"
        )
        floors = {}
        for n in levels:
            if args.model.startswith("v4mini"):  # from the file's tensors, as stored
                floor = 1e3 * file_bytes_per_step(path, n, V4_MINI["n_routed_experts"], V4_MINI["num_experts_per_tok"])
                floor /= bw
            else:
                try:
                    floor = 1e3 * weight_bytes_per_step(cfg, n) / bw
                except KeyError:
                    floor = float("nan")
            floors[n] = floor
            h = hf_dec.get(n, float("nan"))
            log(
                f"| decode ms/step, {n} req | {h:.2f} | {di_dec[n]:.2f} | {h / di_dec[n]:.2f}x faster | {floor:.3f} | "
                f"{di_dec[n] / floor:.1f}x |"
            )
            log(f"| decode tok/s, {n} req | {1e3 * n / h:,.0f} | {1e3 * n / di_dec[n]:,.0f} | | | |")
            if n in serial_dec:
                log(
                    f"| decode ms/step, {n} req, overlap off | | {serial_dec[n]:.2f} | overlap gains "
                    f"{serial_dec[n] / di_dec[n]:.2f}x | | |"
                )
            if n in eager_dec:
                log(
                    f"| decode ms/step, {n} req, CUDA graphs off | | {eager_dec[n]:.2f} | graphs gain "
                    f"{eager_dec[n] / di_dec[n]:.2f}x | | |"
                )
        log(f"| prefill tok/s, 64 x 512 | {hf_pre:,.0f} | {di_pre:,.0f} | {di_pre / hf_pre:.2f}x | | |")
        log(f"| peak GPU MiB | {hf_peak:.0f} | {di_peak:.0f} | | | |")
        if args.model.startswith("v4mini"):
            file_mib = checkpoint_bytes(path) / 2**20
            log(f"| checkpoint file MiB | | {file_mib:.0f} | peak / file {di_peak / file_mib:.2f}x | | |")
            log(f"| weights held MiB | | {weights_mib:.0f} | held / file {weights_mib / file_mib:.2f}x | | |")
            log(
                f"| peak after load MiB (KV cache {kv_mib:.0f}) | | {load_peak:.0f} | "
                f"/ (file + KV) {load_peak / (file_mib + kv_mib):.2f}x | | |"
            )
            report["file_mib"] = file_mib
        report.update(
            di_decode=di_dec,
            di_decode_serial=serial_dec,
            di_decode_eager=eager_dec,
            hf_decode=hf_dec,
            di_prefill=di_pre,
            hf_prefill=hf_pre,
            di_peak=di_peak,
            hf_peak=hf_peak,
            floor_ms=floors,
        )
    if args.json:
        write_json(args.json, report)
    return 0


@contextlib.contextmanager
def shared_expert_apart():
    """The cuda_sm100 plugin as before 2026-12-07's launch cuts: a MoE layer with a SwiGLU clamp
    (DeepSeek-V4) runs its shared expert as its own MLP instead of one more row of the routed
    GEMVs, and ``hc_pre`` declines (the hyper-connections' input norm and projection as torch ops,
    then ``hc_mix``). An engine built inside captures its graphs so."""
    from deepinfer_cuda_sm100.kernels import hyper_connection
    from deepinfer_cuda_sm100.moe import TritonMoEDispatcher

    fold, pre = TritonMoEDispatcher.forward_with_shared, hyper_connection.hc_pre

    def apart(self, spec, *args, **kwargs):
        return None if spec.swiglu_limit is not None else fold(self, spec, *args, **kwargs)

    TritonMoEDispatcher.forward_with_shared = apart
    hyper_connection.hc_pre = lambda *args, **kwargs: None
    try:
        yield
    finally:
        TritonMoEDispatcher.forward_with_shared, hyper_connection.hc_pre = fold, pre


def ab_fold(llm: LLM, path: str, levels: list[int], vocab: int, steps: int) -> dict:
    """Decode ms/step, the shared expert folded (``llm``) against apart (a second engine built and
    run inside :func:`shared_expert_apart`), two alternations; both engines alive."""
    ab_levels = [n for n in levels if n <= 64]
    with shared_expert_apart():
        old = di(path, "bfloat16", max_num_seqs=max(ab_levels), kv_cache_blocks=max(ab_levels) * 2 + 300)
    ab = {"folded": [], "apart": []}
    for _ in range(2):
        log("  A/B shared expert folded:")
        ab["folded"].append(di_speed(llm, vocab, ab_levels, steps, 128))
        log("  A/B shared expert apart:")
        with shared_expert_apart():
            ab["apart"].append(di_speed(old, vocab, ab_levels, steps, 128))
    del old
    free()
    log("A/B decode ms/step, now vs without the shared-expert fold and hc_pre (graphs re-captured), two alternations:")
    log("| requests | now | before | before / now |\n|---:|---|---|---:|")
    for n in ab_levels:
        a, b = [r[n] for r in ab["folded"]], [r[n] for r in ab["apart"]]
        log(f"| {n} | {a[0]:.3f}, {a[1]:.3f} | {b[0]:.3f}, {b[1]:.3f} | {min(b) / min(a):.3f}x |")
    return ab


def write_json(path: str, report: dict) -> None:
    """Rows: model, requests, decode_ms and tok_s (deepinfer; transformers, overlap off, graphs off) and one
    row with requests 0 for the 64 x 512 prefill's tok/s; ``raw`` keeps every measure as measured."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_json

    rows = [
        {
            "model": report["model"],
            "requests": n,
            "decode_ms": ms,
            "tok_s": 1e3 * n / ms,
            "transformers_decode_ms": report.get("hf_decode", {}).get(n),
            "overlap_off_ms": report.get("di_decode_serial", {}).get(n),
            "graphs_off_ms": report.get("di_decode_eager", {}).get(n),
        }
        for n, ms in report.get("di_decode", {}).items()
    ]
    if "di_prefill" in report:
        rows.append(
            {
                "model": report["model"],
                "requests": 0,
                "prefill_tok_s": report["di_prefill"],
                "transformers_prefill_tok_s": report.get("hf_prefill"),
            }
        )
    bench_json.write(
        path, "gpu_throughput", rows, peer="transformers generate (same run)", accelerator=report["device"], raw=report
    )


if __name__ == "__main__":
    sys.exit(main())

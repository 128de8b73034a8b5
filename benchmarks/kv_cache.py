"""Persistent KV cache: time to first token in a fresh process, cold vs served from the store.

For each prompt length, in fresh processes (model load not timed, store open included):

1. cold: ``LLM(model, kv_store=local:///tmp/...)`` computes the prompt (0% hits) and writes
   its blocks back; TTFT = wall time of ``generate(prompt, max_tokens=1)``;
2. warm: a new process with the same store serves the same prompt (~97-98% of its tokens
   from the store; the last partial block is computed); TTFT again, and the bandwidth the
   store -> host load reached;
3. the peer for that bandwidth: a plain sequential read of the same record files, in this
   process, right after (both see the OS page cache the writer left, which is what a
   machine that serves from local disk sees too).

Then decode time per step with and without write-back (a 100-token prompt, 384 new tokens, so
three blocks fill and are written during decode), each in a fresh process.

    python benchmarks/kv_cache.py --lengths 4096,8192
    python benchmarks/kv_cache.py --tiny-v4 --lengths 16384,32768   # a random tiny DeepSeek-V4 (transformers builds it)

SmolLM2's context is 8K; the 16K and 32K rows use ``--tiny-v4`` (random weights, random token
ids: the timing does not depend on the weights' values).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODEL = "smollm2-135m-instruct"


def prompt_ids(tokenizer, n: int) -> list[int]:
    if tokenizer is None:  # a checkpoint without a tokenizer (--tiny-v4): fixed random ids
        import random

        rng = random.Random(n)
        return [rng.randrange(2, 300) for _ in range(n)]
    text = " ".join(f"Row {i}: the {['red', 'green', 'blue', 'gold'][i % 4]} fox meets dog {i * 13} near tree {i % 97}." for i in range(n // 8 + 64))
    ids = tokenizer.encode(text)
    assert len(ids) >= n, (len(ids), n)
    return ids[:n]


def child(args) -> None:
    from deepinfer_core import LLM, SamplingParams

    llm = LLM(args.model, device="cpu", kv_store=args.store or None, max_num_batched_tokens=2048, max_model_len=args.length + 512 if args.mode == "ttft" else None, kv_cache_blocks=args.length // 128 + 8 if args.mode == "ttft" else None)
    tok = llm.get_tokenizer()
    if args.mode == "ttft":
        ids = prompt_ids(tok, args.length)
        start = time.perf_counter()
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
        ttft = time.perf_counter() - start
        llm.engine.tiers.flush()
        tiers = llm.engine.stats()["kv_tiers"]
        print(json.dumps({"ttft": ttft, "cached": out.num_cached_tokens, "prompt": len(ids), "load_seconds": tiers.get("load_seconds", 0.0), "load_bytes": tiers.get("load_bytes", 0), "token": out.outputs[0].token_ids}))
        return
    ids = prompt_ids(tok, 100)
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=4))  # warm up
    times = []
    llm.engine.add_request(ids[::-1], params)  # a fresh prompt: its blocks are new to the store
    while llm.engine.has_unfinished_requests():
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    if llm.engine.tiers is not None:
        llm.engine.tiers.flush()
        written = llm.engine.stats()["kv_tiers"].get("blocks_written", 0)
    else:
        written = 0
    decode = sorted(times[1:])  # the first step is the prefill
    print(json.dumps({"per_step": sum(decode) / len(decode), "median": decode[len(decode) // 2], "steps": len(decode), "blocks_written": written}))


def run_child(model: str, mode: str, length: int, store: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--model", model, "--length", str(length), "--store", store]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plain_read(root: str) -> tuple[int, float]:
    """Read every record file sequentially; (bytes, seconds)."""
    paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv")]
    total = 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            total += len(f.read())
    return total, time.perf_counter() - start


def make_tiny_v4(path: str) -> str:
    """The tiny random DeepSeek-V4 of the V4 tests (``deepinfer_core.testing.v4_tiny``), with a
    33K context."""
    import torch
    import transformers

    from deepinfer_core.testing.v4_tiny import tiny_v4_config

    config = tiny_v4_config(
        max_position_embeddings=33792,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8448, "beta_fast": 32, "beta_slow": 1},
    )
    torch.manual_seed(0)
    transformers.DeepseekV4ForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--decode-tokens", type=int, default=384)
    parser.add_argument("--child", choices=["ttft", "decode"])
    parser.add_argument("--length", type=int, default=0)
    parser.add_argument("--store", default="")
    parser.add_argument("--tiny-v4", action="store_true", help="a random tiny DeepSeek-V4 with a 33K context instead of --model")
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        return child(args)
    if args.tiny_v4:
        args.model = make_tiny_v4(tempfile.mkdtemp(prefix="kvbench-v4-"))
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")

    print(f"# deepinfer persistent KV cache, {args.model}, CPU, local store (fresh process per row)")
    print("| prompt | TTFT 0% hits (s) | TTFT from store (s) | hit % | ratio | store load GB/s | plain read GB/s | load/read |")
    print("|---|---|---|---|---|---|---|---|")
    for length in [int(x) for x in args.lengths.split(",")]:
        with tempfile.TemporaryDirectory(prefix="kvbench-") as root:
            url = f"local://{root}"
            cold = run_child(args.model, "ttft", length, url)
            warm = run_child(args.model, "ttft", length, url)
            assert warm["token"] == cold["token"], "the first token differs between cold and warm"
            nbytes, seconds = plain_read(root)
        load_bw = warm["load_bytes"] / warm["load_seconds"] / 1e9 if warm["load_seconds"] else float("nan")
        read_bw = nbytes / seconds / 1e9
        print(f"| {length} | {cold['ttft']:.2f} | {warm['ttft']:.2f} | {100 * warm['cached'] / warm['prompt']:.1f} | {cold['ttft'] / warm['ttft']:.1f}x | {load_bw:.2f} | {read_bw:.2f} | {load_bw / read_bw:.2f} |", flush=True)

    if args.decode_tokens <= 0:
        print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        return
    with tempfile.TemporaryDirectory(prefix="kvbench-") as root:
        without = run_child(args.model, "decode", 0, "")
        with_wb = run_child(args.model, "decode", 0, f"local://{root}")
    print()
    print("| decode | ms/step (mean) | ms/step (median) | blocks written during decode |")
    print("|---|---|---|---|")
    print(f"| no store | {1e3 * without['per_step']:.2f} | {1e3 * without['median']:.2f} | 0 |")
    print(f"| write-back to local store | {1e3 * with_wb['per_step']:.2f} | {1e3 * with_wb['median']:.2f} | {with_wb['blocks_written']} |")
    print(f"| ratio (with / without) | {with_wb['per_step'] / without['per_step']:.3f} | {with_wb['median'] / without['median']:.3f} | |")
    print(f"| decode tok/s (no store / write-back) | {1 / without['per_step']:.1f} / {1 / with_wb['per_step']:.1f} | | |")
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

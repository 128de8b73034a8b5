"""DeepSeek-V4 prefill after a persistent-store hit: exact vs compact SWA replay, against no cache.

    python benchmarks/gpu/v4_replay_prefill.py --model v4mini --contexts 512,1024,2048,3584   # a GPU
    python benchmarks/gpu/v4_replay_prefill.py --device cpu --model tiny                      # a CPU

A store hit brings back a prompt's block KV (compressed entries, indexer keys) but not its window
state (the sliding-window rings and compressor tails are never written to the store), so the
engine that hits rebuilds that state by replaying tokens before the hit: ``exact`` the last
``layers x (window - 1) + window`` of them, ``compact`` only the last ``swa_replay_keep`` (140)
with attention bounded to them (REFERENCE.md section 5; docs/kv-cache.md).

For each cached context C: a writer engine serves ``--reps`` prompts of C + ``--suffix`` random
tokens with the store on and flushes it. Then one engine per mode (window cache off, prefix
caching and the same store on) serves, one at a time, those prompts' first C tokens followed by
``--suffix`` new ones, ``max_tokens=1``: the request's wall time (store read, replay, the suffix,
one sampled token) and the tokens its prefill computed (``swa_num_replayed_tokens`` + the
uncached suffix). The peer in the same run is the same query on an engine with no store and no
prefix cache (the whole prompt prefilled). Each engine first serves one warm-up query of its own
(kernels compiled, graphs captured) before the timed ones; the median of ``--reps`` is reported.

V4-mini (``--model v4mini``: gpu_throughput.py's 8-layer, window-128 checkpoint, random bf16
weights; ``v4mini-fp8``: FP8 projections + MXFP4 experts) needs a GPU; ``--model tiny`` is a
window-128, 8-layer model at test widths (float32, for a CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def log(*a) -> None:
    print(*a, flush=True)


def make_checkpoint(model: str, folder: str) -> None:
    if model == "tiny":
        from deepinfer_core.testing.v4_tiny import save_tiny_v4, tiny_v4_config

        S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
        cfg = tiny_v4_config(
            layer_types=[S, C, H, C, H, C, H, S],
            sliding_window=128,
            num_hidden_layers=8,
            mlp_layer_types=["hash_moe"] + ["moe"] * 7,
            max_position_embeddings=4096,
        )
        save_tiny_v4(folder, seed=7, randomise_seed=8, config=cfg)
        return
    import gpu_throughput

    (gpu_throughput.make_v4mini_fp8 if model == "v4mini-fp8" else gpu_throughput.make_v4mini)(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["v4mini", "v4mini-fp8", "tiny"], default="v4mini")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", default="512,1024,2048,3584", help="cached tokens before the new suffix")
    ap.add_argument("--suffix", type=int, default=64, help="new prompt tokens after the hit")
    ap.add_argument("--reps", type=int, default=3, help="timed queries per context and engine (median)")
    ap.add_argument("--keep", type=int, default=140, help="compact replay's swa_replay_keep")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--json", default=None, help="write the result file (bench_json.py)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device here: use --device cpu --model tiny")
    if args.device == "cpu" and args.model != "tiny":
        ap.error(f"--model {args.model} is sized for a GPU: use --model tiny on a CPU")
    from deepinfer_core import LLM, SamplingParams

    contexts = [int(c) for c in args.contexts.split(",")]
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    root = tempfile.mkdtemp(prefix="v4replay")
    path, store = os.path.join(root, "ckpt"), f"local://{os.path.join(root, 'store')}"
    t = time.perf_counter()
    make_checkpoint(args.model, path)
    log(f"{args.model} checkpoint written in {time.perf_counter() - t:.0f} s")
    block = 128
    blocks = 4 * ((max(contexts) + args.suffix) // block + 2)

    def engine(**kw) -> LLM:
        return LLM(path, device=args.device, dtype=dtype, kv_cache_blocks=blocks, block_size=block, **kw)

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    writer = engine(kv_store=store)
    vocab = writer.engine.model.vocab_size
    exact_n = writer.engine.model.kv_layout(block).exact_replay_tokens

    def rand(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    # per context: a warm-up prompt then the timed ones, each written to the store as C + suffix tokens
    bases = {c: [rand(c + args.suffix) for _ in range(args.reps + 1)] for c in contexts}
    queries = {c: [b[:c] + rand(args.suffix) for b in bases[c]] for c in contexts}
    t = time.perf_counter()
    writer.generate([b for c in contexts for b in bases[c]], one, use_tqdm=False)
    writer.engine.tiers.flush()
    written = writer.engine.stats()["kv_tiers"]["blocks_written"]
    log(f"store written: {written} blocks in {time.perf_counter() - t:.1f} s")
    del writer

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    modes = {
        "no cache": dict(enable_prefix_caching=False),
        "exact": dict(kv_store=store, window_cache_seconds=0, swa_replay="exact"),
        "compact": dict(kv_store=store, window_cache_seconds=0, swa_replay="compact", swa_replay_keep=args.keep),
    }
    measured: dict[tuple[str, int], dict] = {}
    for mode, options in modes.items():
        llm = engine(**options)
        for c in contexts:
            times, computed, cached, replayed = [], [], [], []
            for i, q in enumerate(queries[c]):
                sync()
                t = time.perf_counter()
                out = llm.generate([q], one, use_tqdm=False)[0]
                sync()
                if i == 0:  # the warm-up query: kernels compiled for this context's shapes
                    continue
                times.append(1e3 * (time.perf_counter() - t))
                r = int(out.metrics.get("swa_num_replayed_tokens", 0))
                replayed.append(r)
                cached.append(out.num_cached_tokens)
                computed.append(r + len(q) - out.num_cached_tokens)
            if mode != "no cache" and min(cached) != c:
                raise SystemExit(f"{mode}: expected {c} cached tokens from the store, got {cached}")
            measured[mode, c] = {
                "ms": statistics.median(times),
                "computed": statistics.median(computed),
                "replayed": statistics.median(replayed),
            }
            m = measured[mode, c]
            log(f"{mode:>8} C={c}: {m['ms']:.1f} ms, {m['computed']:.0f} tokens computed")
        del llm
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    log(
        f"\n{args.model} on {device} ({dtype}): one request of C cached + {args.suffix} new tokens, store hit, window "
        f"cache off; exact replay length {exact_n}, compact keep {args.keep}; median of {args.reps}\n"
    )
    log("| cached C | no cache: ms (tokens) | exact: ms (tokens) | compact: ms (tokens) | exact / no cache | "
        "compact / no cache | compact / exact |")  # fmt: skip
    log("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for c in contexts:
        n, e, k = measured["no cache", c], measured["exact", c], measured["compact", c]
        row = {
            "context": c,
            "suffix": args.suffix,
            "no_cache_ms": round(n["ms"], 2),
            "exact_ms": round(e["ms"], 2),
            "compact_ms": round(k["ms"], 2),
            "no_cache_tokens": n["computed"],
            "exact_tokens": e["computed"],
            "compact_tokens": k["computed"],
            "exact_replayed": e["replayed"],
            "compact_replayed": k["replayed"],
        }
        rows.append(row)
        log(
            f"| {c} | {n['ms']:.1f} ({n['computed']:.0f}) | {e['ms']:.1f} ({e['computed']:.0f}) | "
            f"{k['ms']:.1f} ({k['computed']:.0f}) | {e['ms'] / n['ms']:.2f}x | {k['ms'] / n['ms']:.2f}x | "
            f"{k['ms'] / e['ms']:.2f}x |"
        )
    shutil.rmtree(root, ignore_errors=True)
    if args.json:
        import bench_json

        bench_json.write(
            args.json,
            "v4_replay_prefill",
            rows,
            peer="the same query on an engine with no store and no prefix cache (whole prompt prefilled), same run",
            accelerator=device if args.device.startswith("cuda") else "",
            notes=f"{args.model}, {dtype}, exact replay length {exact_n}, keep {args.keep}, median of {args.reps}",
        )


if __name__ == "__main__":
    main()

"""Persistent KV cache: time to first token in a fresh process, cold vs served from the store.

For each prompt length, in fresh processes (model load not timed, store open included):

1. cold: ``LLM(model, kv_store=local:///tmp/...)`` computes the prompt (0% hits) and writes
   its blocks back; TTFT = wall time of ``generate(prompt, max_tokens=1)``;
2. warm: a new process with the same store serves the same prompt (~97-98% of its tokens
   from the store; the last partial block is computed); TTFT again, and the bandwidth the
   store -> KV cache load reached (on the CPU the records are read straight into the cache
   blocks); then once more through host buffers (``--host-path``: store -> host pool, then
   a copy per layer into the cache at admission, the path a GPU takes), for the comparison;
3. the peer for that bandwidth: a plain sequential read of the same record files, in this
   process, right after (both see the OS page cache the writer left, which is what a
   machine that serves from local disk sees too).

Then decode time per step with and without write-back (100-token prompts, 384 new tokens, so
three blocks fill and are written during each decode): one process, two engines of the same
model decoding the same fresh prompt step by step in lockstep (A B, B A, ...), ``--reps`` times,
each side's mean and median per step reported with the ratio (the issue's line: within 5%). ``--lengths ""`` runs only
the decode part.

    python benchmarks/kv/kv_cache.py --lengths 4096,8192
    python benchmarks/kv/kv_cache.py --tiny-v4 --lengths 16384,32768
    # (a random tiny DeepSeek-V4, transformers builds it)

SmolLM2's context is 8K; the 16K and 32K rows use ``--tiny-v4`` (random weights, random token
ids: the timing does not depend on the weights' values).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    text = " ".join(
        f"Row {i}: the {['red', 'green', 'blue', 'gold'][i % 4]} fox meets dog {i * 13} near tree {i % 97}."
        for i in range(n // 8 + 64)
    )
    ids = tokenizer.encode(text)
    assert len(ids) >= n, (len(ids), n)
    return ids[:n]


def child(args) -> None:
    from deepinfer_core import LLM, SamplingParams

    llm = LLM(
        args.model,
        device="cpu",
        kv_store=(args.store or None) if args.mode == "ttft" else None,
        max_num_batched_tokens=2048,
        max_model_len=args.length + 512 if args.mode == "ttft" else None,
        kv_cache_blocks=args.length // 128 + 8 if args.mode == "ttft" else None,
    )
    tok = llm.get_tokenizer()
    if args.host_path:
        llm.engine.tiers.direct = False
    if args.mode == "ttft":
        ids = prompt_ids(tok, args.length)
        start = time.perf_counter()
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
        ttft = time.perf_counter() - start
        llm.engine.tiers.flush()
        tiers = llm.engine.stats()["kv_tiers"]
        print(
            json.dumps(
                {
                    "ttft": ttft,
                    "cached": out.num_cached_tokens,
                    "prompt": len(ids),
                    "load_seconds": tiers.get("load_seconds", 0.0) + tiers.get("host_to_device_seconds", 0.0),
                    "load_bytes": tiers.get("load_bytes", 0),
                    "token": out.outputs[0].token_ids,
                }
            )
        )
        return
    decode_child(args, llm, tok)


def decode_lockstep(engines: dict, ids: list[int], params) -> dict[str, list[float]]:
    """One request per engine, stepped in lockstep (A B, B A, A B, ...): the wall time of
    each engine's decode steps (prefill left out). Why lockstep: on a shared machine the load
    changes from second to second; neighbouring steps of the two engines see the same load."""
    for llm in engines.values():
        llm.engine.add_request(ids, params)
    times: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    turn = 0
    while any(llm.engine.has_unfinished_requests() for llm in engines.values()):
        for name in names if turn % 2 == 0 else names[::-1]:
            engine = engines[name].engine
            if engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
        turn += 1
    return {name: steps[1:] for name, steps in times.items()}


def decode_child(args, plain, tok) -> None:
    """Decode per step with and without write-back, in one process: two engines of the same
    model (one without a store, one writing back to a local store) decoding the same fresh
    prompt in lockstep, ``--reps`` times (a fresh prompt each time: its blocks are new to the
    store and to both device caches)."""
    from deepinfer_core import LLM, SamplingParams

    stored = LLM(args.model, device="cpu", kv_store=args.store, max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    base = prompt_ids(tok, 100 + 16 * args.reps)
    for llm in (plain, stored):
        llm.generate([base[-100:][::-1]], SamplingParams(temperature=0, max_tokens=4))  # warm up
    rows = []
    for rep in range(args.reps):
        steps = decode_lockstep({"without": plain, "with": stored}, base[16 * rep : 16 * rep + 100], params)
        rows.append(
            {
                name: {"mean": statistics.fmean(s), "median": statistics.median(s), "max": max(s)}
                for name, s in steps.items()
            }
        )
    stored.engine.tiers.flush()
    tiers = stored.engine.stats()["kv_tiers"]
    print(
        json.dumps(
            {
                "rows": rows,
                "steps": args.decode_tokens - 1,
                "blocks_written": tiers.get("blocks_written", 0),
                "on_step_loop": tiers.get("write_back_step_seconds", 0.0),
                "steps_total": tiers.get("write_back_steps", 0),
            }
        )
    )


def run_child(model: str, mode: str, length: int, store: str, extra: tuple[str, ...] = ()) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--model",
        model,
        "--length",
        str(length),
        "--store",
        store,
        *extra,
    ]
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
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8448,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    torch.manual_seed(0)
    transformers.DeepseekV4ForCausalLM(config).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--decode-tokens", type=int, default=384)
    parser.add_argument("--reps", type=int, default=6, help="decode repetitions per side (alternating)")
    parser.add_argument("--child", choices=["ttft", "decode"])
    parser.add_argument("--length", type=int, default=0)
    parser.add_argument("--store", default="")
    parser.add_argument("--host-path", action="store_true", help="child: load through host buffers, not into the cache")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON (benchmarks/bench_json.py)")
    parser.add_argument(
        "--tiny-v4", action="store_true", help="a random tiny DeepSeek-V4 with a 33K context instead of --model"
    )
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        return child(args)
    if args.tiny_v4:
        args.model = make_tiny_v4(tempfile.mkdtemp(prefix="kvbench-v4-"))
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")

    print(f"# deepinfer persistent KV cache, {args.model}, CPU, local store (fresh process per row)")
    print(
        "store -> cache GB/s: the load's bytes over the time to read them (and, through host buffers, to copy them "
        "into the cache)"
    )
    print(
        "| prompt | TTFT 0% hits (s) | TTFT from store (s) | hit % | ratio | store -> cache GB/s | via host buffers: "
        "TTFT (s) | ratio | GB/s | plain read GB/s | load/read |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results: list[dict] = []
    for length in [int(x) for x in args.lengths.split(",") if x]:
        with tempfile.TemporaryDirectory(prefix="kvbench-") as root:
            url = f"local://{root}"
            cold = run_child(args.model, "ttft", length, url)
            via_host = run_child(args.model, "ttft", length, url, ("--host-path",))
            warm = run_child(args.model, "ttft", length, url)
            assert warm["token"] == cold["token"] == via_host["token"], "the first token differs between cold and warm"
            nbytes, seconds = plain_read(root)
        bw = {
            name: r["load_bytes"] / r["load_seconds"] / 1e9 if r["load_seconds"] else float("nan")
            for name, r in (("direct", warm), ("host", via_host))
        }
        read_bw = nbytes / seconds / 1e9
        print(
            f"| {length} | {cold['ttft']:.2f} | {warm['ttft']:.2f} | {100 * warm['cached'] / warm['prompt']:.1f} | "
            f"{cold['ttft'] / warm['ttft']:.1f}x | {bw['direct']:.2f} | {via_host['ttft']:.2f} | "
            f"{cold['ttft'] / via_host['ttft']:.1f}x | {bw['host']:.2f} | {read_bw:.2f} | {bw['direct'] / read_bw:.2f} "
            f"|",
            flush=True,
        )
        results.append(
            {
                "prompt_tokens": length,
                "miss_ttft_s": cold["ttft"],
                "hit_ttft_s": warm["ttft"],
                "hit_via_host_ttft_s": via_host["ttft"],
                "hit_percent": 100 * warm["cached"] / warm["prompt"],
                "load_gb_s": bw["direct"],
                "plain_read_gb_s": read_bw,
            }
        )

    if args.decode_tokens <= 0:
        print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        write_json(args, results, None)
        return
    with tempfile.TemporaryDirectory(prefix="kvbench-") as root:
        got = run_child(
            args.model,
            "decode",
            0,
            f"local://{root}",
            ("--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps)),
        )
    rows = got["rows"]
    print()
    print(
        f"# decode per step, one process, two engines in lockstep (100-token prompts, {args.decode_tokens} new tokens, "
        f"{len(rows)} repetitions; {got['blocks_written']} blocks written in all)"
    )
    print(
        "| repetition | without: ms/step mean | median | with write-back: ms/step mean | median | ratio of means | "
        "ratio of medians |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        w, wb = r["without"], r["with"]
        print(
            f"| {i + 1} | {1e3 * w['mean']:.2f} | {1e3 * w['median']:.2f} | {1e3 * wb['mean']:.2f} | "
            f"{1e3 * wb['median']:.2f} | {wb['mean'] / w['mean']:.3f} | {wb['median'] / w['median']:.3f} |"
        )
    med = {
        side: {k: statistics.median(r[side][k] for r in rows) for k in ("mean", "median")}
        for side in ("without", "with")
    }
    w, wb = med["without"], med["with"]
    print(
        f"| median of repetitions | {1e3 * w['mean']:.2f} | {1e3 * w['median']:.2f} | {1e3 * wb['mean']:.2f} | "
        f"{1e3 * wb['median']:.2f} | {wb['mean'] / w['mean']:.3f} | {wb['median'] / w['median']:.3f} |"
    )
    print(
        f"write-back's own time on the step loop (device -> host copies, queueing): {1e3 * got['on_step_loop']:.2f} ms "
        f"in {got['steps_total']} steps = {1e6 * got['on_step_loop'] / got['steps_total']:.1f} us/step"
    )
    ratios = sorted(r["with"]["mean"] / r["without"]["mean"] for r in rows)
    print(
        f"median ratio of per-repetition means (with / without): {statistics.median(ratios):.3f} (range "
        f"{ratios[0]:.3f}-{ratios[-1]:.3f}); goal <= 1.050"
    )
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    write_json(args, results, statistics.median(ratios))


def write_json(args: argparse.Namespace, rows: list[dict], decode_ratio: float | None) -> None:
    """Rows: prompt_tokens, miss_ttft_s (0% hits), hit_ttft_s (served from the store, read into the cache),
    hit_via_host_ttft_s, hit_percent, load_gb_s, plain_read_gb_s; decode_write_back_ratio: the median
    ratio of decode ms/step with write-back over without."""
    if not args.json:
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench_json

    bench_json.write(
        args.json,
        "kv_cache",
        rows,
        peer="the same prompt computed with no stored blocks (0% hits), and a plain read of the store's files",
        notes=f"{args.model}, CPU, local store, fresh process per row",
        decode_write_back_ratio=decode_ratio,
    )


if __name__ == "__main__":
    main()

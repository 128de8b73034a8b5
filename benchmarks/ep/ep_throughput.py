"""Expert-parallel throughput (EP=1 vs EP=2 on CPU gloo) and the pause of an expert re-placement.

The same greedy batch (``--requests`` prompts of ``--prompt-len`` random tokens, ``--new-tokens``
each) through a small random DeepSeek-V3 (float32, transformers' own initialisation, saved once)
on: one process (EP=1, the peer), DP=2 x EP=2 (two rank processes, each scheduling half the
requests, routed tokens exchanged with all_to_all_single over gloo) and DP=1 x EP=2 (rank 1 holds
experts only). Tokens must equal EP=1's (checked). Throughput is output tokens / wall seconds of
``generate`` after a warm-up batch; the ratio is to EP=1 on one thread (each rank takes
``cores / ranks`` threads; EP=1 on all cores is shown too). On a CPU the ranks share the same
cores, so this measures the exchange's overhead more than a speed-up (a multi-GPU run is a
separate issue); on a machine shared with other jobs, multi-threaded runs suffer most.

Re-placement: during a DP=2 x EP=2 generation the experts are moved to a scrambled table (every
expert changes rank or slot, the worst case: all weights of every MoE layer move); each rank
reports the pause (the load all_reduce, the plan broadcast and the layer-by-layer all_to_all of
the weights), measured inside the step loop.

Part of ``benchmarks/ep/ep.py`` (``--part throughput``); also runs alone:

    python benchmarks/ep/ep_throughput.py --json benchmarks/results/ep_throughput.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

MODEL = {
    "vocab_size": 512, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 512,
    "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 128, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "max_position_embeddings": 1024, "initializer_range": 0.05,
}  # fmt: skip
# (name, data_parallel_size, expert_parallel_size, torch threads of the one process; ranks take cores / ranks)
SETUPS = (
    ("EP=1, 1 thread", 1, 1, 1),
    ("EP=1, all cores", 1, 1, os.cpu_count() or 1),
    ("DP=2 x EP=2", 2, 2, None),
    ("DP=1 x EP=2", 1, 2, None),
)


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, MODEL["vocab_size"], (length,), generator=g).tolist() for _ in range(n)]


def _run(path: str, dp: int, ep: int, threads: int | None, args) -> dict:
    from deepinfer_core import LLM, SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=64, data_parallel_size=dp,
              expert_parallel_size=ep, max_num_seqs=args.requests)  # fmt: skip
    started = time.perf_counter() - start
    try:
        llm.generate(_prompts(2, 8), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(args.requests, args.prompt_len), params)
        wall = time.perf_counter() - t0
        pauses = []
        if dp == 2 and ep == 2:  # a forced re-placement in the middle of a generation
            layers = MODEL["num_hidden_layers"] - MODEL["first_k_dense_replace"]
            scrambled = torch.stack([torch.roll(torch.arange(MODEL["n_routed_experts"]), 5)] * layers)
            seen = 0
            for out in llm.stream(_prompts(args.requests, args.prompt_len), params):
                seen += 1
                if seen == args.requests:
                    llm.engine.rebalance(scrambled)
            pauses = [r["replacements"][-1]["pause_s"] for r in llm.engine.rank_report() if r["replacements"]]
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"start_s": started, "wall_s": wall, "tokens": tokens, "pauses_s": pauses}


def throughput_part(args) -> list[dict]:
    """Rows for ``ep.py``'s JSON: one per setup (tok/s, ratio to EP=1, tokens equal)."""
    from deepinfer_core.testing.v3_checkpoint import tiny_deepseek_v3

    rows = []
    with tempfile.TemporaryDirectory() as path:
        tiny_deepseek_v3(path, seed=0, router_gain=4.0, **MODEL)
        results = {name: _run(path, dp, ep, threads, args) for name, dp, ep, threads in SETUPS}
    base = results[SETUPS[0][0]]
    out_tokens = args.requests * args.new_tokens
    for name, dp, ep, threads in SETUPS:
        r = results[name]
        rows.append({
            "part": "throughput", "setup": name, "data_parallel_size": dp, "expert_parallel_size": ep,
            "threads": threads if threads is not None else max(1, (os.cpu_count() or 1) // max(dp, ep)),
            "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "tok_s": out_tokens / r["wall_s"], "ratio_to_ep1": base["wall_s"] / r["wall_s"],  # EP=1, 1 thread
            "tokens_equal_ep1": r["tokens"] == base["tokens"], "start_s": r["start_s"],
            "replacement_pause_s": max(r["pauses_s"]) if r["pauses_s"] else None,
        })  # fmt: skip
    return rows


def print_throughput(rows: list[dict]) -> None:
    print(f"\nEP throughput, small random DeepSeek-V3 (16 experts top-4, hidden 512), float32, CPU gloo, "
          f"{rows[0]['requests']} requests x {rows[0]['new_tokens']} new tokens")  # fmt: skip
    print(f"{'setup':22s} {'threads':>7s} {'tok/s':>8s} {'x EP=1':>7s} {'same tokens':>12s} {'start s':>8s} "
          f"{'re-place pause':>15s}")  # fmt: skip
    for r in rows:
        pause = f"{r['replacement_pause_s'] * 1e3:.1f} ms" if r["replacement_pause_s"] is not None else "-"
        same = str(r["tokens_equal_ep1"])
        print(f"{r['setup']:22s} {r['threads']:7d} {r['tok_s']:8.1f} {r['ratio_to_ep1']:7.2f} {same:>12s} "
              f"{r['start_s']:8.1f} {pause:>15s}")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", help="write the rows (and the machine) to this file")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    rows = throughput_part(args)
    print_throughput(rows)
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import bench_json

        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        bench_json.write(args.json, "ep_throughput", rows, peer="EP=1 in one process (same run)",
                         notes=f"CPU gloo; 1-min load average at the end {load:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

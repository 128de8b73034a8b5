"""The CPU default checked on batches it was not tuned on, against the dequantized float32 model.

    .venv/bin/python benchmarks/cpu/lowbit_mixed_check.py --concurrency 2,3,5,16,17,48,64

For each concurrency N: N requests whose prompts cycle through 1, 7, 127, 129, 500 and 2,000
tokens arrive in 3 waves two steps apart (later ones join while earlier ones decode), on an
engine of ``max_num_seqs=16`` (more requests than slots above 16) and a KV pool of
``--kv-blocks`` blocks of 128 tokens (too small for all of them: preemption and recompute).
Every output token is checked against the float32 model teacher-forced on the same prefix
(``deepinfer_core.testing.greedy_check``): the reference's argmax, or within ``--tolerance``
of its largest logit. Prints a table per concurrency; a quality check, not a speed one
(tests/test_lowbit_mixed_batches.py runs a small case of it in CI).
"""

from __future__ import annotations

import argparse
import os
import time

LENGTHS = (1, 7, 127, 129, 500, 2000)
TEXT = (
    "Of the many tools a carpenter keeps, the plane is the one an apprentice learns last. It asks for a sharp iron, "
    "a steady hand and patience with the grain, which turns and rises where the board was cut across an old knot. "
    "Most of the craft is in the sharpening, which takes longer than the planing itself, and in knowing when to stop. "
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3, 5, 16, 17, 48, 64]
    )
    parser.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")), default=LENGTHS)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=40,
        help="blocks of 128 tokens (40: ~5,000 tokens, under 48 x 2,000-token-class batches)",
    )
    parser.add_argument("--tolerance", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from deepinfer_core import LLM
    from deepinfer_core.testing.greedy_check import check_greedy, mixed_prompts, run_arriving

    longest = max(args.lengths) + args.new_tokens
    dense = LLM(
        "smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_blocks=-(-longest // 128) + 1, max_num_seqs=1
    ).engine
    print(
        f"load average {os.getloadavg()[0]:.1f}; prompts cycle through {args.lengths} tokens, {args.new_tokens} new "
        f"tokens, "
        f"3 arrival waves, max_num_seqs 16, {args.kv_blocks} KV blocks of 128, tolerance {args.tolerance}"
    )
    print(
        "\n| requests | tokens checked | the float32 argmax | worst gap | misses | preemptions | native multi-token "
        "steps | s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.concurrency:
        start = time.perf_counter()
        llm = LLM(
            "smollm2-135m-instruct",
            device="cpu",
            max_num_seqs=16,
            kv_cache_blocks=args.kv_blocks,
            enable_prefix_caching=False,
        )
        prompts = mixed_prompts(llm.get_tokenizer(), n, args.lengths, TEXT)
        counts = {"native": 0}
        model = llm.engine.model
        forward = model.forward

        def counted(input_ids, positions, kv_caches, meta, forward=forward, model=model):
            hidden = forward(input_ids, positions, kv_caches, meta)
            plan = model.fused_step  # built by the first forward
            if plan is not None and meta.max_query_len > 1 and plan.applies_prefill(input_ids, meta):
                counts["native"] += 1
            return hidden

        model.forward = counted
        outputs = run_arriving(llm, prompts, args.new_tokens, waves=3)
        report = check_greedy(dense, prompts, outputs, args.tolerance)
        bad = sum(len(o) != args.new_tokens for o in outputs)
        print(
            f"| {n} | {report.tokens} | {report.exact} | {report.worst_gap:.3f} | "
            f"{len(report.misses)}{f' (+{bad} short)' if bad else ''} | "
            f"{llm.engine.scheduler.num_preemptions} | {counts['native']} | {time.perf_counter() - start:.0f} |",
            flush=True,
        )
        for miss in report.misses[:5]:
            print(f"|   miss: {miss} |")
        del llm


if __name__ == "__main__":
    main()

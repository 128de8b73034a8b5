"""Tiny DeepSeek-V4 on CPU: deepinfer vs transformers ``generate``, same random model, same run.

No small V4 checkpoint is published, so a random one is built (seeded) with every layer kind
(sliding, CSA, HCA), hash and learned MoE layers and hyper-connections, saved with transformers'
``save_pretrained`` and loaded by both engines in float32. Per concurrency level N: N distinct
prompts of ``--prompt-tokens`` ids, ``--new-tokens`` greedy tokens each (EOS ignored);
score = N x new tokens / wall time of the batch (prefill included), after an untimed warm-up.
transformers runs one batched ``generate`` (equal-length prompts, no padding). Request 0's
tokens are compared (greedy agreement).

    .venv/bin/python benchmarks/cpu/v4_cpu_decode.py --concurrency 1,8 --prompt-tokens 512 --new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time

import torch
import transformers

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.testing.v4_tiny import randomise_zero_initialised

CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=8,
    head_dim=64,
    q_lora_rank=128,
    partial_rotary_factor=0.25,
    num_experts_per_tok=4,
    n_routed_experts=16,
    routed_scaling_factor=1.5,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "sliding_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    hc_mult=4,
    hc_sinkhorn_iters=20,
    sliding_window=128,
    o_groups=4,
    o_lora_rank=64,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=64,
    max_position_embeddings=8192,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    bos_token_id=0,
    eos_token_id=1,
)


def build(path: str) -> transformers.DeepseekV4ForCausalLM:
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**CONFIG)).eval()
    randomise_zero_initialised(model, 1)  # what transformers initialises to zero carries information in a real model
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",")]
    g = torch.Generator().manual_seed(2)
    with tempfile.TemporaryDirectory() as path:
        hf = build(path)
        llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=max(levels), enable_prefix_caching=False)
        rows = []
        for n in levels:
            prompts = [
                torch.randint(2, CONFIG["vocab_size"], (args.prompt_tokens,), generator=g).tolist() for _ in range(n)
            ]
            params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
            llm.generate(
                [p[::-1] for p in prompts], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            )  # warm-up
            t_ours, outs = timed(lambda: llm.generate(prompts, params))
            ids = torch.tensor(prompts)
            with torch.no_grad():
                hf.generate(ids.flip(1), attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
                t_hf, ref = timed(
                    lambda: hf.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens,
                        do_sample=False,
                    )
                )
            ours0, ref0 = outs[0].outputs[0].token_ids, ref[0, args.prompt_tokens :].tolist()
            agree = next((i for i, (a, b) in enumerate(zip(ours0, ref0)) if a != b), len(ref0))
            tok = n * args.new_tokens
            rows.append((n, tok / t_ours, tok / t_hf, agree))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"tiny DeepSeek-V4 (random, {CONFIG['num_hidden_layers']} layers: sliding/CSA/HCA, hash+learned MoE, hc_mult "
        f"{CONFIG['hc_mult']}), float32, "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens (greedy), {args.threads} threads; "
        f"{platform.machine()}, "
        f"load {os.getloadavg()[0]:.1f}; deepinfer at {rev}\n"
    )
    print(
        "| concurrency | deepinfer tok/s | transformers tok/s | deepinfer / transformers | greedy agreement (request "
        "0) |"
    )
    print("|---:|---:|---:|---:|---|")
    for n, ours, theirs, agree in rows:
        print(f"| {n} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {agree}/{args.new_tokens} |")


if __name__ == "__main__":
    main()

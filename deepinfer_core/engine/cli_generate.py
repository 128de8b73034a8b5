"""``deepinfer generate``: run prompts through the offline engine from the command line."""
from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts", description="Generate completions with the offline engine.")
    p.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file)")
    p.add_argument("--model", "-m", default="smollm2-135m-instruct", help="path to a GGUF file / HF directory, or an installed alias (default: %(default)s)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the model's chat template")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-blocks", type=int, default=None)
    p.add_argument("--attention-backend", default=None, help="plugin whose attention kernels to use, or 'builtin' (default: installed plugins by name, then builtin)")
    p.add_argument("--moe-backend", default=None, help="plugin whose MoE dispatcher to use, or 'builtin' (default: as for --attention-backend)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated (one prompt)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("deepinfer generate: no prompt given (pass prompts or --prompts-file)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs, kv_cache_blocks=args.kv_cache_blocks, attention_backend=args.attention_backend, moe_backend=args.moe_backend)
        if args.stream and len(prompts) == 1 and not args.chat:
            for out in llm.stream(prompts[0], params):
                print(out.outputs[0].delta_text, end="", flush=True)
            print()
            return 0
        if args.chat:
            results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
        else:
            results = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"deepinfer generate: error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, results):
        o = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": o.text, "finish_reason": o.finish_reason, "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(o.token_ids), "cached_tokens": out.num_cached_tokens}))
        else:
            print(f"--- {prompt!r} ({o.finish_reason}, {len(o.token_ids)} tokens)\n{o.text}")
    return 0

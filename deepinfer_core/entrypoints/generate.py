"""``deepinfer generate``: run prompts through the offline engine from the command line.

Errors a user can fix (bad arguments, a missing file, a device that is not there) print one
line and exit with status 2; a request the engine gave up on prints its reason and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..kv_store.url import add_kv_store_arguments
from ..engine.kv_dtype_names import KV_CACHE_DTYPES


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate completions with the offline engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file)")
    p.add_argument(
        "--model",
        "-m",
        default="smollm2-135m-instruct",
        help="path to a GGUF file / HF directory, or an installed alias",
    )
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the model's chat template"
    )
    p.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:1, ... or auto (the first usable installed platform)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's element type on the low-bit CPU path: auto (float16; float32 for an all-8-bit GGUF), float16, float32, or int8 (opt-in: half float16's bytes, a scale per token and head; changes the numbers). Dense weights accept only auto or their dtype",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (CPU: a quantized GGUF's weights kept packed, low-bit kernels; dense weights bfloat16 with AVX512-BF16/AMX, else float32; bfloat16 elsewhere), lowbit (the same), or float32 / bfloat16 / float16 (dense; float32 is the exact reference)",
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads for torch (default: torch's choice, one per core; on a busy machine fewer is faster)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="new tokens per prompt at most (the Python API's SamplingParams defaults to 16)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 disables it")
    p.add_argument("--top-k", type=int, default=0, help="0 disables it")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (per request)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together at most")
    p.add_argument(
        "--kv-cache-blocks", type=int, default=None, help="KV cache size in blocks (default: sized from free memory)"
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        help="plugin whose attention kernels to use, or 'builtin' (default: installed plugins by name, then builtin)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="never replay captured decode graphs")
    p.add_argument(
        "--moe-backend",
        default=None,
        help="plugin whose MoE dispatcher to use, or 'builtin' (default: as for --attention-backend)",
    )
    add_kv_store_arguments(p)
    p.add_argument(
        "--stream", action="store_true", help="print tokens as they are generated (prompts one after another)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..plugin_host import PluginConflictError
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    prompts = list(args.prompts)
    try:
        if args.prompts_file:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        return _usage_error(f"cannot read --prompts-file: {exc}")
    if not prompts:
        return _usage_error("no prompt given (pass prompts or --prompts-file)")
    if args.stream and args.json:
        return _usage_error("--stream prints text as it comes; it cannot be combined with --json")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
            stop=args.stop,
        )
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs,
            kv_cache_blocks=args.kv_cache_blocks,
            attention_backend=args.attention_backend,
            moe_backend=args.moe_backend,
            enforce_eager=args.enforce_eager,
            kv_store=args.kv_store,
            kv_store_gib=args.kv_store_gib,
        )
        if args.stream:
            return _stream(llm, prompts, params, args.chat)
        if args.chat:
            results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
        else:
            results = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except (ValueError, TypeError, OSError, LookupError, PluginConflictError) as exc:
        return _usage_error(str(exc))
    for prompt, out in zip(prompts, results):
        o = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": o.text,
                        "finish_reason": o.finish_reason,
                        "prompt_tokens": len(out.prompt_token_ids),
                        "completion_tokens": len(o.token_ids),
                        "cached_tokens": out.num_cached_tokens,
                        **({"error": o.error} if o.error else {}),
                    }
                )
            )
        else:
            print(f"--- {prompt!r} ({o.finish_reason}, {len(o.token_ids)} tokens)\n{o.text}")
            if o.error:
                print(f"deepinfer generate: error: {o.error}", file=sys.stderr)
    return 1 if any(out.outputs[0].error for out in results) else 0


def _stream(llm, prompts: list[str], params, chat: bool) -> int:
    """Each prompt in turn, its text printed as it is generated (under a header when there
    are several)."""
    failed = False
    for prompt in prompts:
        if len(prompts) > 1:
            print(f"--- {prompt!r}", flush=True)
        if chat:
            ids, text = llm._encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
            source = {"prompt_token_ids": ids, "prompt": text}
        else:
            source = prompt
        for out in llm.stream(source, params):
            print(out.outputs[0].delta_text, end="", flush=True)
            if out.outputs[0].error:
                failed = True
                print(f"\ndeepinfer generate: error: {out.outputs[0].error}", file=sys.stderr)
        print()
    return 1 if failed else 0


def _usage_error(message: str) -> int:
    print(f"deepinfer generate: error: {message}", file=sys.stderr)
    return 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

"""``deepinfer generate``: run prompts through the offline engine from the command line.

Errors a user can fix (bad arguments, a missing file, a device that is not there) print one
line and exit with status 2; a request the engine gave up on prints its reason and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from .engine_options import add_engine_options, add_model_option, engine_kwargs


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate completions with the offline engine.",
    )
    p.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file / --prompt-token-ids)")
    add_model_option(p)
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument(
        "--prompt-token-ids",
        action="append",
        type=_token_ids,
        default=None,
        metavar="IDS",
        help="a prompt given as comma-separated token ids, e.g. 1,2,3 (repeatable; for models without a tokenizer)",
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the model's chat template"
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads for torch (default: torch's choice, one per core; on a busy machine fewer is faster)",
    )
    sampling = p.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="new tokens per prompt at most (the Python API's SamplingParams defaults to 16) (default: %(default)s)",
    )
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    sampling.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling; 1 disables it (default: %(default)s)"
    )
    sampling.add_argument("--top-k", type=int, default=0, help="0 disables it (default: %(default)s)")
    sampling.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="one sampling seed for every prompt (default: each request's seed is drawn from the engine's --seed)",
    )
    sampling.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument(
        "--stream", action="store_true", help="print tokens as they are generated (prompts one after another)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_options(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams
    from ..plugin_host import PluginConflictError

    prompts: list = list(args.prompts)
    try:
        if args.prompts_file:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        return _usage_error(f"cannot read --prompts-file: {exc}")
    if args.prompt_token_ids:
        if args.chat:
            return _usage_error("--chat renders text messages; it cannot be combined with --prompt-token-ids")
        prompts += args.prompt_token_ids
    if not prompts:
        return _usage_error("no prompt given (pass prompts, --prompts-file or --prompt-token-ids)")
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
            seed=args.sampling_seed,
            max_tokens=args.max_tokens,
            stop=args.stop,
        )
        llm = LLM(args.model, **engine_kwargs(args))
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
                        "token_ids": list(o.token_ids),
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
            if isinstance(prompt, list):  # token ids in, token ids out (the model may have no tokenizer)
                print(f"token ids: {' '.join(map(str, o.token_ids))}")
            if o.error:
                print(f"deepinfer generate: error: {o.error}", file=sys.stderr)
    return 1 if any(out.outputs[0].error for out in results) else 0


def _stream(llm, prompts: list, params, chat: bool) -> int:
    """Each prompt in turn, its text printed as it is generated (under a header when there
    are several); for a prompt of token ids, the new token ids."""
    failed = False
    for prompt in prompts:
        if len(prompts) > 1:
            print(f"--- {prompt!r}", flush=True)
        if chat:
            ids, text = llm._encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
            source = {"prompt_token_ids": ids, "prompt": text}
        else:
            source = prompt
        printed = 0
        for out in llm.stream(source, params):
            if isinstance(prompt, list):
                new, printed = out.outputs[0].token_ids[printed:], len(out.outputs[0].token_ids)
                print("".join(f"{token} " for token in new), end="", flush=True)
            else:
                print(out.outputs[0].delta_text, end="", flush=True)
            if out.outputs[0].error:
                failed = True
                print(f"\ndeepinfer generate: error: {out.outputs[0].error}", file=sys.stderr)
        print()
    return 1 if failed else 0


def _usage_error(message: str) -> int:
    print(f"deepinfer generate: error: {message}", file=sys.stderr)
    return 2


def _token_ids(text: str) -> list[int]:
    """``1,2,3`` -> ``[1, 2, 3]`` (spaces allowed); refused unless every item is an id >= 0."""
    try:
        ids = [int(item) for item in text.replace(" ", "").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, got {text!r}")
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids are whole numbers >= 0, got {text!r}")
    return ids


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

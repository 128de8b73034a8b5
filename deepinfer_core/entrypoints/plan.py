"""``deepinfer plan``: KV-cache capacity of a model from its config (the computation is
:func:`deepinfer_core.plan.plan`). It takes the engine options every command takes; the ones
that size the cache (device, dtype, kv_cache_dtype, block_size, max_num_seqs, max_model_len,
kv_cache_gib) are the ones it reads, and ``--kv-cache-gib`` is required."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from .engine_options import add_engine_options, add_model_option, engine_kwargs, positive_float, require


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="KV-cache capacity of a model from its config (no weights needed)",
        description="KV-cache capacity of a model from its config alone, before any weights are downloaded: "
        "the blocks and bytes an engine given --kv-cache-gib allocates, and how many requests of "
        "--max-model-len tokens fit at once.",
    )
    add_model_option(p, help="HF directory (config.json is enough), GGUF file, or installed alias")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_engine_options(p, required=("kv_cache_gib",))
    # the flag's name before the engine options were generated
    p.add_argument(
        "--kv-gib", dest="kv_cache_gib", type=positive_float, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..engine.config import engine_config
    from ..plan import format_plan, plan
    from ..plugin_host import PluginConflictError

    missing = require(args, "kv_cache_gib")
    if missing:
        return _fail(missing + " (the KV budget to plan for, GiB)")
    try:
        config = engine_config(args.model, **engine_kwargs(args))
        result = plan(
            config.model,
            config.kv_cache_gib,
            max_model_len=config.max_model_len,
            dtype=config.dtype,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            device=config.device,
            kv_cache_dtype=config.kv_cache_dtype,
            weight_format=config.weight_format,
        )
    except (ValueError, TypeError, OSError, LookupError, PluginConflictError) as exc:
        return _fail(str(exc))
    print(json.dumps(asdict(result), indent=2) if args.json else format_plan(result))
    return 0


def _fail(message: str) -> int:
    print(f"deepinfer plan: error: {message}", file=sys.stderr)
    return 2

"""Write a tiny random DeepSeek-V4 checkpoint in the released layout (names, dtypes, FP8 / MXFP4).

    python scripts/make_tiny_v4_checkpoint.py OUT_DIR [--weights fp8|bf16] [--experts fp4|fp8|bf16]
        [--seed N] [--config overrides.json]

The writer lives in :mod:`deepinfer_core.testing.v4_checkpoint` (tests import it from there);
this file re-exports it so that ``import make_tiny_v4_checkpoint`` works from ``scripts/`` too.
"""

from __future__ import annotations

import argparse
import json

from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, random_released_weights, write_tiny_v4_checkpoint

__all__ = ["TINY_V4_CONFIG", "random_released_weights", "write_tiny_v4_checkpoint", "main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--weights", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--experts", choices=["fp4", "fp8", "bf16"], default="fp4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", help="JSON file whose keys override the tiny config")
    args = parser.parse_args(argv)
    config = dict(TINY_V4_CONFIG)
    if args.config:
        with open(args.config) as f:
            config |= json.load(f)
    write_tiny_v4_checkpoint(args.out_dir, weights=args.weights, experts=args.experts, config=config, seed=args.seed)
    print(f"wrote {args.out_dir} ({args.weights}, experts {args.experts if args.weights == 'fp8' else 'bf16'})")


if __name__ == "__main__":
    main()

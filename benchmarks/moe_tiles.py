"""Tile sweep for the cuda_sm100 fused MoE at one shape (default: V3-mini's 64 x 512-token
prefill: 32,768 tokens, 64 experts, top-6, hidden 2048, expert width 1024, bf16).

Times the whole ``fused_moe`` call (alignment, both grouped GEMMs, the fixed-order sum) with
``triton.testing.do_bench`` (median) for each candidate ``MoEConfig``, checks every result
against the default configuration's, and prints a table, fastest first. Used to pick
``choose_config``'s prefill tiles (benchmarks/README.md)."""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from deepinfer_cuda_sm100.kernels.fused_moe import MoEConfig, choose_config, fused_moe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    args = ap.parse_args()
    T, E, k, D, I = args.tokens, args.experts, args.top_k, args.hidden, args.inter
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, D, device="cuda", generator=g) / D**0.5).bfloat16()
    down = (torch.randn(E, D, I, device="cuda", generator=g) / I**0.5).bfloat16()
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    w = torch.rand(T, k, device="cuda", generator=g)
    default = choose_config(T * k, E)
    ref, _ = fused_moe(x, gate_up, down, ids, w, None, default)
    flops = 2 * T * k * (2 * I * D + D * I)
    rows = []
    for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4)):
        if bm * bn > 128 * 128 or (bm == 128 and bn == 128 and warps == 4):
            continue
        cfg = MoEConfig(bm, bn, bk, warps, stages)
        try:
            out, _ = fused_moe(x, gate_up, down, ids, w, None, cfg)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = triton.testing.do_bench(lambda: fused_moe(x, gate_up, down, ids, w, None, cfg), warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # out of shared memory / registers for this tile
            print(f"{cfg}: {type(exc).__name__}")
            continue
        rows.append((ms, cfg, err))
    rows.sort(key=lambda r: r[0])
    base = next(ms for ms, cfg, _ in rows if cfg == default)
    print(f"fused_moe T={T} E={E} k={k} D={D} I={I} bf16; default {default}: {base:.2f} ms")
    print("| block_m | block_n | block_k | warps | stages | ms | TFLOP/s | vs default | rel. error |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ms, c, err in rows[:12]:
        print(f"| {c.block_m} | {c.block_n} | {c.block_k} | {c.num_warps} | {c.num_stages} | {ms:.2f} | {flops / ms / 1e9:.0f} | {base / ms:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()

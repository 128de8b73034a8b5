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
    ap.add_argument("--fp8", action="store_true", help="experts in DeepSeek's FP8 block format (BLOCK_K is then 128)")
    ap.add_argument("--decode", action="store_true", help="decode-sized tiles (16/32 rows), e.g. with --tokens 64")
    args = ap.parse_args()
    T, E, k, D, I = args.tokens, args.experts, args.top_k, args.hidden, args.inter
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, D, device="cuda", generator=g) / D**0.5).bfloat16()
    down = (torch.randn(E, D, I, device="cuda", generator=g) / I**0.5).bfloat16()
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    w = torch.rand(T, k, device="cuda", generator=g)
    scales = {}
    if args.fp8:  # random e4m3 values, positive tile scales
        gate_up, down = (gate_up * 64).to(torch.float8_e4m3fn), (down * 64).to(torch.float8_e4m3fn)
        scales = dict(
            gate_up_scale=torch.rand(E, 2 * I // 128, -(-D // 128), device="cuda", generator=g) / 64,
            down_scale=torch.rand(E, -(-D // 128), I // 128, device="cuda", generator=g) / 64,
        )
    default = choose_config(T * k, E)
    ref, _ = fused_moe(x, gate_up, down, ids, w, None, None, **scales)
    base = triton.testing.do_bench(lambda: fused_moe(x, gate_up, down, ids, w, None, None, **scales), warmup=25, rep=100, return_mode="median")
    flops = 2 * T * k * (2 * I * D + D * I)
    touched = ids.unique().numel() * 3 * I * D * gate_up.element_size()  # expert weight bytes read
    rows = []
    grid = itertools.product((64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4))
    if args.decode:
        grid = itertools.product((16, 32), (32, 64, 128), (128,) if args.fp8 else (64,), (4,), (2, 3, 4))
    for bm, bn, bk, warps, stages in grid:
        if bm * bn > 128 * 128 or (bm == 128 and bn == 128 and warps == 4):
            continue
        cfg = MoEConfig(bm, bn, bk, warps, stages)
        try:
            out, _ = fused_moe(x, gate_up, down, ids, w, None, cfg, **scales)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = triton.testing.do_bench(lambda: fused_moe(x, gate_up, down, ids, w, None, cfg, **scales), warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # out of shared memory / registers for this tile
            print(f"{cfg}: {type(exc).__name__}")
            continue
        rows.append((ms, cfg, err))
    rows.sort(key=lambda r: r[0])
    kind = "FP8 experts" if args.fp8 else "bf16"
    print(f"fused_moe T={T} E={E} k={k} D={D} I={I} {kind}; default {default}: {base:.3f} ms")
    print("| block_m | block_n | block_k | warps | stages | ms | TFLOP/s | weight GB/s | vs default | rel. error |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ms, c, err in rows[:12]:
        print(f"| {c.block_m} | {c.block_n} | {c.block_k} | {c.num_warps} | {c.num_stages} | {ms:.3f} | {flops / ms / 1e9:.0f} | {touched / ms / 1e6:,.0f} | {base / ms:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()

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

from deepinfer_cuda_sm100.kernels.fused_moe import MoEConfig, choose_config, choose_down_config, fused_moe


def random_moe_case(T: int, E: int, k: int, D: int, I: int, g: torch.Generator):
    """A random bf16 MoE call on the GPU, drawn from ``g`` in this order: T tokens of width D,
    E experts' gate/up [2I, D] and down [D, I] weights, each token's top-k experts and weights.
    Also used by decode64_sweep.py."""
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, D, device="cuda", generator=g) / D**0.5).bfloat16()
    down = (torch.randn(E, D, I, device="cuda", generator=g) / I**0.5).bfloat16()
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    w = torch.rand(T, k, device="cuda", generator=g)
    return x, gate_up, down, ids, w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--fp8", action="store_true", help="experts in DeepSeek's FP8 block format (BLOCK_K is then 128)")
    ap.add_argument("--decode", action="store_true", help="decode-sized tiles (16/32 rows), e.g. with --tokens 64")
    ap.add_argument(
        "--split",
        action="store_true",
        help="prefill: sweep the gate/up and the down GEMM's tiles and program order apart",
    )
    args = ap.parse_args()
    T, E, k, D, I = args.tokens, args.experts, args.top_k, args.hidden, args.inter
    g = torch.Generator(device="cuda").manual_seed(0)
    x, gate_up, down, ids, w = random_moe_case(T, E, k, D, I, g)
    scales = {}
    if args.fp8:  # random e4m3 values, positive tile scales
        gate_up, down = (gate_up * 64).to(torch.float8_e4m3fn), (down * 64).to(torch.float8_e4m3fn)
        scales = dict(
            gate_up_scale=torch.rand(E, 2 * I // 128, -(-D // 128), device="cuda", generator=g) / 64,
            down_scale=torch.rand(E, -(-D // 128), I // 128, device="cuda", generator=g) / 64,
        )
    default = choose_config(T * k, E)
    ref, _ = fused_moe(x, gate_up, down, ids, w, None, None, **scales)
    base = triton.testing.do_bench(
        lambda: fused_moe(x, gate_up, down, ids, w, None, None, **scales), warmup=25, rep=100, return_mode="median"
    )
    flops = 2 * T * k * (2 * I * D + D * I)
    touched = ids.unique().numel() * 3 * I * D * gate_up.element_size()  # expert weight bytes read
    if args.split:
        return split_sweep(x, gate_up, down, ids, w, scales, ref, base, default, flops)
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
            ms = triton.testing.do_bench(
                lambda: fused_moe(x, gate_up, down, ids, w, None, cfg, **scales),
                warmup=25,
                rep=100,
                return_mode="median",
            )
        except Exception as exc:  # out of shared memory / registers for this tile
            print(f"{cfg}: {type(exc).__name__}")
            continue
        rows.append((ms, cfg, err))
    rows.sort(key=lambda r: r[0])
    kind = "FP8 experts" if args.fp8 else "bf16"
    print(f"fused_moe T={T} E={E} k={k} D={D} I={I} {kind}; default {default}: {base:.3f} ms")
    print(
        "| block_m | block_n | block_k | warps | stages | ms | TFLOP/s | weight GB/s | vs default | rel. error "
        "|\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for ms, c, err in rows[:12]:
        print(
            f"| {c.block_m} | {c.block_n} | {c.block_k} | {c.num_warps} | {c.num_stages} | {ms:.3f} | "
            f"{flops / ms / 1e9:.0f} | {touched / ms / 1e6:,.0f} | {base / ms:.2f}x | {err:.1e} |"
        )


def _time(x, gate_up, down, ids, w, scales, cfg, down_cfg, ref):
    out, _ = fused_moe(x, gate_up, down, ids, w, None, cfg, down_config=down_cfg, **scales)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    ms = triton.testing.do_bench(
        lambda: fused_moe(x, gate_up, down, ids, w, None, cfg, down_config=down_cfg, **scales),
        warmup=25,
        rep=100,
        return_mode="median",
    )
    return ms, err


def kernel_ms(fn) -> dict:
    """GPU time per kernel name of one call (torch profiler, mean of 5 calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    key = "self_device_time_total"
    return {ev.key[:40]: getattr(ev, key) / 5e3 for ev in prof.key_averages() if getattr(ev, key, 0) > 0}


def split_sweep(x, gate_up, down, ids, w, scales, ref, base, default, flops) -> None:
    """Gate/up tilings with the down GEMM fixed, then down tilings with gate/up fixed (same
    block_m: both walk one alignment); ``group_m`` is the program order (0: row tiles fastest),
    ``tma`` the copy engine's tile loads (MoEConfig.tma)."""
    tma = [(128, 128, 64, 8, s, 8, True) for s in (3, 4)] + [
        (128, 128, 128, 8, 2, 8, True),
        (128, 64, 64, 4, 4, 8, True),
    ]
    gu_grid = [(128, 128, 64, 8, 3, 8)] + tma  # the default (pointer loads) first; earlier sweeps: benchmarks/README.md
    dn_grid = [(128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8)] + tma + [(128, 256, 64, 8, s, 8, True) for s in (3, 4)]
    rows_n = ids.numel()
    fixed = {"gate/up": choose_down_config(rows_n, gate_up.shape[0]), "down": choose_config(rows_n, gate_up.shape[0])}
    res = {}
    for name, grid in (("gate/up", gu_grid), ("down", dn_grid)):
        rows = []
        for c in grid:
            cfg = MoEConfig(*c)
            pair = (cfg, fixed[name]) if name == "gate/up" else (fixed[name], cfg)
            try:
                ms, err = _time(x, gate_up, down, ids, w, scales, *pair, ref)
            except Exception as exc:  # out of shared memory / registers for this tile
                print(f"{name} {cfg}: {type(exc).__name__}")
                continue
            rows.append((ms, cfg, err))
            print(f"{name} {cfg}: {ms:.3f} ms", flush=True)
        rows.sort(key=lambda r: r[0])
        res[name] = rows
        print(
            f"\n{name} sweep (the other GEMM fixed at its default); whole fused_moe, default {default}: {base:.3f} ms"
        )
        print(
            "| block_m | block_n | block_k | warps | stages | group_m | tma | ms | vs default | rel. error "
            "|\n|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
        )
        for ms, c, err in rows:
            print(
                f"| {c.block_m} | {c.block_n} | {c.block_k} | {c.num_warps} | {c.num_stages} | {c.group_m} | {c.tma} | "
                f"{ms:.3f} | {base / ms:.2f}x | {err:.1e} |"
            )
    best = None
    for bm in (128,):
        gu = [r for r in res["gate/up"] if r[1].block_m == bm]
        dn = [r for r in res["down"] if r[1].block_m == bm]
        if gu and dn:
            ms, err = _time(x, gate_up, down, ids, w, scales, gu[0][1], dn[0][1], ref)
            print(
                f"best pair at block_m {bm}: {gu[0][1]} + {dn[0][1]}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), "
                f"{base / ms:.2f}x the default, rel. error {err:.1e}"
            )
            if best is None or ms < best[0]:
                best = (ms, gu[0][1], dn[0][1])
    rows_n, D, I = ids.numel(), x.shape[1], down.shape[2]
    if not scales:  # the peer: cuBLAS on one dense GEMM of each shape (same FLOPs, no gather, no experts)
        a, b = torch.randn(rows_n, D, device="cuda").bfloat16(), torch.randn(2 * I, D, device="cuda").bfloat16()
        h, c = torch.randn(rows_n, I, device="cuda").bfloat16(), torch.randn(D, I, device="cuda").bfloat16()
        t1 = triton.testing.do_bench(lambda: a @ b.t(), warmup=25, rep=100, return_mode="median")
        t2 = triton.testing.do_bench(lambda: h @ c.t(), warmup=25, rep=100, return_mode="median")
        f1, f2 = 2 * rows_n * D * 2 * I, 2 * rows_n * I * D
        print(
            f"cuBLAS dense, same shapes: [{rows_n} x {D}] @ [{D} x {2 * I}] {t1:.3f} ms ({f1 / t1 / 1e9:.0f} TFLOP/s), "
            f"[{rows_n} x {I}] @ [{I} x {D}] {t2:.3f} ms ({f2 / t2 / 1e9:.0f} TFLOP/s)"
        )
        del a, b, h, c
    for label, cfg, dcfg in (("default", None, None), ("best", best[1], best[2])):
        parts = kernel_ms(lambda: fused_moe(x, gate_up, down, ids, w, None, cfg, down_config=dcfg, **scales))
        print(
            f"kernels, {label}: "
            + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:8])
        )


if __name__ == "__main__":
    main()

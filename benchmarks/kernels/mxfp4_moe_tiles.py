"""Tilings of the fused MoE on packed MXFP4 experts at decode sizes (DeepSeek-V4-mini's shape:
64 experts, top-6, hidden 2048, width 1024), each alone on a GPU, timed as a CUDA graph replays it
(``triton.testing.do_bench_cudagraph``, median), beside the peers in the same run: the same call
on the experts dequantized to bf16 (the 16-bit decode tiles) and the weight-read floor (bytes of
the experts the batch touches over the measured copy bandwidth).

Gate/up tilings with the down GEMM at its default, then down tilings with gate/up at its
default, each result checked against the reference on dequantized weights.

H100, 2026-12-07 (copy 2.45 TB/s): 0.313 ms the whole call at 64 tokens (384 rows, 64 experts),
bf16 experts 0.276 ms, the floor 0.087 ms; the best of 48 tilings 1.02x the default, and
decoding the even and odd inputs apart (two half-depth dots, no interleave; tried and removed)
slower than every interleaved tiling: the decode's arithmetic, not the tiling or the bytes,
bounded the call. The cheaper decode of 320b157 (kernels/mxfp4.py): 0.274 ms at 64 tokens,
0.207 at 16, 0.0237 at 1 (0.88x / 0.84x / 0.64x the decode before, H100, 2026-12-08).

    python benchmarks/kernels/mxfp4_moe_tiles.py [--tokens 16,64] [--no-tilings]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from decode64_sweep import bench  # this folder is first on sys.path when run as a script

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu"))
from gpu_throughput import copy_bandwidth  # noqa: E402

from deepinfer_cuda_sm100.kernels import fused_moe as fm
from deepinfer_cuda_sm100.kernels.moe_gemv import MOE_GEMV_ROWS

GRID = [  # (block_n, block_k, warps, stages)
    (bn, bk, w, st) for bn in (64, 128) for bk in (64, 128, 256) for w in (4, 8) for st in (2, 3)
]


def packed_case(T: int, E: int, k: int, D: int, I: int):
    """Random packed experts (any byte is two e2m1 codes; exponents around 2^-4 .. 2^-7, of the
    order of a checkpoint's groups) and a random routing."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()

    def codes(*shape):
        return torch.randint(0, 256, shape, device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)

    def exponents(*shape):
        return torch.randint(120, 124, shape, device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)

    gu, gus = codes(E, 2 * I, D // 2), exponents(E, 2 * I, D // 32)
    dn, dns = codes(E, D, I // 2), exponents(E, D, I // 32)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    w = torch.rand(T, k, device="cuda", generator=g)
    return x, (gu, gus, dn, dns), ids, w


def sweep(T: int, E=64, k=6, D=2048, I=1024, bw=1.0, tilings: bool = True) -> list[dict]:
    from deepinfer_core.moe import ExpertWeights

    x, (gu, gus, dn, dns), ids, w = packed_case(T, E, k, D, I)
    plain = ExpertWeights(gu, dn, gus, dns).dequantized(torch.bfloat16)
    scales = dict(gate_up_scale=gus, down_scale=dns)
    touched = ids.unique().numel()
    floor = touched * (gu[0].numel() + dn[0].numel() + gus[0].numel() + dns[0].numel()) / (bw * 1e12) * 1e3
    ref, _ = fm.fused_moe(x, plain.gate_up, plain.down, ids, w)
    bf16 = bench(lambda: fm.fused_moe(x, plain.gate_up, plain.down, ids, w))
    gemv = T * k <= MOE_GEMV_ROWS
    default = bench(lambda: fm.fused_moe(x, gu, dn, ids, w, **scales))
    base_cfg = fm.choose_config(T * k, E)
    print(f"\nMXFP4 MoE T={T} ({T * k} rows, {touched} experts touched): default {'GEMV' if gemv else base_cfg} "
          f"{default:.4f} ms | bf16 experts {bf16:.4f} ms | floor {floor:.4f} ms at {bw:.2f} TB/s "
          f"(default {default / floor:.2f}x floor)", flush=True)  # fmt: skip
    table = [
        {"tokens": T, "call": "default tiling, MXFP4", "ms": round(default, 4), "x_floor": round(default / floor, 2)},
        {"tokens": T, "call": "bf16 experts (peer)", "ms": round(bf16, 4), "x_floor": round(bf16 / floor, 2)},
        {"tokens": T, "call": "weight-read floor (peer)", "ms": round(floor, 4), "x_floor": 1.0},
    ]
    for name in ("gate/up", "down") if tilings else ():
        rows = []
        for bn, bk, warps, stages in GRID:
            cfg = fm.MoEConfig(16, bn, bk, warps, stages)
            gu_cfg, dn_cfg = (cfg, base_cfg) if name == "gate/up" else (base_cfg, cfg)
            try:
                out, _ = fm.fused_moe(x, gu, dn, ids, w, None, gu_cfg, down_config=dn_cfg, **scales)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = bench(lambda: fm.fused_moe(x, gu, dn, ids, w, None, gu_cfg, down_config=dn_cfg, **scales))
            except Exception as exc:  # a tiling past the shared memory
                print(f"  {name} {cfg}: {type(exc).__name__} {str(exc)[:80]}")
                continue
            rows.append((ms, cfg, err))
        rows.sort(key=lambda r: r[0])
        if rows:
            ms, c, _ = rows[0]
            table.append({"tokens": T, "call": f"best {name} tiling: bn={c.block_n} bk={c.block_k} w={c.num_warps} "
                          f"s={c.num_stages}", "ms": round(ms, 4), "x_floor": round(ms / floor, 2)})  # fmt: skip
        print(f"MXFP4 T={T} {name} tilings (other GEMM at {base_cfg}), whole fused_moe ms, best 12:")
        for ms, c, err in rows[:12]:
            print(f"  {ms:.4f} ({default / ms:.2f}x default)  bn={c.block_n} bk={c.block_k} w={c.num_warps} "
                  f"s={c.num_stages}  rel.err {err:.1e}")  # fmt: skip
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64")
    ap.add_argument("--json", default=None, help="write the result file (benchmarks/bench_json.py's schema)")
    ap.add_argument("--tilings", action=argparse.BooleanOptionalAction, default=True,
                    help="sweep the tilings (--no-tilings: the default call and its peers only, seconds)")  # fmt: skip
    args = ap.parse_args()
    bw = copy_bandwidth() / 1e12
    print(f"{torch.cuda.get_device_name()}: copy {bw:.2f} TB/s (read + write)")
    rows = [row for T in (int(t) for t in args.tokens.split(",")) for row in sweep(T, bw=bw, tilings=args.tilings)]
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import bench_json

        bench_json.write(
            args.json, "mxfp4_moe_tiles", rows, peer="bf16 experts in the same call; the weight-read floor",
            accelerator=torch.cuda.get_device_name(0), notes=f"copy {bw:.2f} TB/s (read + write)",
        )  # fmt: skip


if __name__ == "__main__":
    main()

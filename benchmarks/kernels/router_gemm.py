"""The cuda_sm100 router logits (``kernels/router.py``) against the reference expression at
each batch size, on a GPU: ``F.linear(x.float(), w)`` (a float32 copy of the rows plus a
float32 GEMM) vs the plugin's choice (``router_logits``: the GEMV up to ``ROUTER_ROWS``, the
tiled tensor-core GEMM from ``ROUTER_TILE_ROWS``) and the tiled GEMM at every size with 64- and
128-token blocks, to place the thresholds. Median of ``triton.testing.do_bench`` per call;
each result is checked against float64."""

from __future__ import annotations

import argparse

import torch
import triton

from deepinfer_cuda_sm100.kernels.router import ROUTER_ROWS, ROUTER_TILE_ROWS, router_gemm, router_logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", default="1,16,32,64,128,256,512,2048,8192,32768")
    args = ap.parse_args()
    E, D = args.experts, args.hidden
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(E, D, device="cuda", generator=g) / D**0.5
    print(
        f"router logits, E={E} D={D}, bf16 rows, float32 weight; thresholds: GEMV <= {ROUTER_ROWS}, tiled >= "
        f"{ROUTER_TILE_ROWS}"
    )
    print(
        "| tokens | torch ms | plugin ms | torch / plugin | tiled 64 ms | tiled 128 ms | max abs err vs float64 (torch "
        "/ tiled) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        exact = x.double() @ w.double().t()
        ref = torch.nn.functional.linear(x.float(), w)
        tiled = router_gemm(x, w, block_t=128)
        errs = ((ref.double() - exact).abs().max().item(), (tiled.double() - exact).abs().max().item())
        times = [
            triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            for fn in (
                lambda: torch.nn.functional.linear(x.float(), w),
                lambda: router_logits(x, w),
                lambda: router_gemm(x, w, block_t=64),
                lambda: router_gemm(x, w, block_t=128),
            )
        ]
        print(
            f"| {T} | {times[0]:.4f} | {times[1]:.4f} | {times[0] / times[1]:.2f}x | {times[2]:.4f} | {times[3]:.4f} | "
            f"{errs[0]:.1e} / {errs[1]:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

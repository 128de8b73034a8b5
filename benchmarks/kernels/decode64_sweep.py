"""Launch choices of the kernels of a 64-request V3-mini bf16 decode step, each alone on a GPU,
timed as a CUDA graph replays them (``triton.testing.do_bench_cudagraph``, median):

* the fused MoE (64 tokens, 64 experts, top-6, hidden 2048, width 1024): gate/up tilings with
  the down GEMM fixed, then down tilings with gate/up fixed (pointer loads or the copy engine);
* MLA decode attention over the paged cache (64 requests x 161 tokens, 16 heads of 576 / 512):
  key tile, split count, warps, stages;
* the router logits (64 bf16 rows x float32 [64, 2048]): torch's cast + float32 GEMM, the GEMV
  kernel, the tiled kernel at smaller tiles;
* ``moe_align`` at 384 rows (chunk width, warps).

    python benchmarks/kernels/decode64_sweep.py [--only moe,attn,router,align]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from moe_tiles import random_moe_case  # this folder is first on sys.path when run as a script

from deepinfer_cuda_sm100.kernels import fused_moe as fm
from deepinfer_cuda_sm100.kernels import paged_attention as pa
from deepinfer_cuda_sm100.kernels import router as rt


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def sweep_moe(T=64, E=64, k=6, D=2048, I=1024) -> None:
    x, gate_up, down, ids, w = random_moe_case(T, E, k, D, I, torch.Generator(device="cuda").manual_seed(0))
    default = fm.choose_config(T * k, E)
    ref, _ = fm.fused_moe(x, gate_up, down, ids, w, None, default, down_config=default)
    base = bench(lambda: fm.fused_moe(x, gate_up, down, ids, w, None, default, down_config=default))
    align = bench(lambda: fm.moe_align(ids, E, 16))
    touched = ids.unique().numel()
    print(
        f"MOE default {default}: {base:.4f} ms whole fused_moe (align alone {align:.4f} ms); experts touched "
        f"{touched}; expert bytes {touched * 3 * I * D * 2 / 1e6:.0f} MB",
        flush=True,
    )
    grid = [
        (64, 64, 4, 3, False),
        (64, 64, 4, 4, False),
        (64, 64, 4, 5, False),
        (64, 64, 4, 3, True),
        (64, 64, 4, 4, True),
        (64, 64, 4, 6, True),
        (64, 128, 4, 3, False),
        (64, 128, 4, 4, False),
        (64, 128, 4, 3, True),
        (64, 128, 4, 4, True),
        (32, 128, 4, 4, False),
        (32, 128, 4, 4, True),
        (32, 64, 4, 4, True),
        (32, 64, 2, 4, False),
        (32, 128, 2, 4, True),
        (128, 64, 4, 3, True),
        (128, 64, 8, 4, True),
        (64, 64, 8, 4, True),
        (64, 128, 8, 4, True),
        (64, 256, 8, 3, True),
        (64, 64, 2, 4, False),
        (64, 64, 2, 4, True),
        (32, 256, 4, 3, True),
        (16, 128, 2, 4, True),
    ]
    for name in ("gate/up", "down"):
        rows = []
        for bn, bk, warps, stages, tma in grid:
            cfg = fm.MoEConfig(16, bn, bk, warps, stages, 0, tma)
            pair = (cfg, default) if name == "gate/up" else (default, cfg)
            try:
                out, _ = fm.fused_moe(x, gate_up, down, ids, w, None, pair[0], down_config=pair[1])
                same = torch.equal(out, ref)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = bench(lambda: fm.fused_moe(x, gate_up, down, ids, w, None, pair[0], down_config=pair[1]))
            except Exception as exc:
                print(f"  {name} {cfg}: {type(exc).__name__} {str(exc)[:80]}")
                continue
            rows.append((ms, cfg, same, err))
        rows.sort(key=lambda r: r[0])
        print(f"MOE {name} sweep (other GEMM default), whole fused_moe ms; default {base:.4f}")
        for ms, c, same, err in rows:
            print(
                f"  {ms:.4f} ({base / ms:.3f}x)  bn={c.block_n} bk={c.block_k} w={c.num_warps} s={c.num_stages} "
                f"tma={c.tma}  equal={same} err={err:.1e}"
            )


def sweep_attn(R=64, ctx=161, H=16, D=576, DV=512) -> None:
    bs = 128
    blocks_per = -(-ctx // bs)
    g = torch.Generator(device="cuda").manual_seed(1)
    cache = torch.randn(1, 1, R * blocks_per + 4, bs, D, device="cuda", generator=g).bfloat16()
    bt = torch.randperm(R * blocks_per, device="cuda", generator=g).int().view(R, blocks_per)
    bt = torch.nn.functional.pad(bt, (0, 32 - blocks_per))  # the graph's table width (4096 tokens)
    q = torch.randn(R, H, D, device="cuda", generator=g).bfloat16()
    qsl = torch.arange(R + 1, device="cuda", dtype=torch.int32)
    sl = torch.full((R,), ctx, device="cuda", dtype=torch.int32)
    kw = dict(max_query_len=1, max_seq_len=32 * bs, scale=D**-0.5, v_head_dim=DV, kv_shared=True)
    ref = pa.paged_attention(q, cache, bt, qsl, sl, **kw)
    base = bench(lambda: pa.paged_attention(q, cache, bt, qsl, sl, **kw))
    auto = pa.choose_config(H, D, 1, R, 32 * bs, False)
    print(f"ATTN R={R} ctx={ctx}: default {auto}: {base:.4f} ms (KV bytes {R * ctx * D * 2 / 1e6:.1f} MB)", flush=True)
    rows = []
    for bn, warps, stages in itertools.product((16, 32, 64), (4, 8), (1, 2, 3)):
        for splits in (1, 2, 3, 4, 6, 8):
            cfg = pa.LaunchConfig(16, bn, splits, warps, stages)
            try:
                out = pa.paged_attention(q, cache, bt, qsl, sl, config=cfg, **kw)
                err = ((out.float() - ref.float()).abs().max()).item()
                ms = bench(lambda: pa.paged_attention(q, cache, bt, qsl, sl, config=cfg, **kw))
            except Exception as exc:
                print(f"  {cfg}: {type(exc).__name__} {str(exc)[:80]}")
                break
            rows.append((ms, cfg, err))
    rows.sort(key=lambda r: r[0])
    for ms, c, err in rows[:20]:
        print(
            f"  {ms:.4f} ({base / ms:.3f}x)  bn={c.block_n} splits={c.num_splits} w={c.num_warps} s={c.num_stages} "
            f"maxerr={err:.1e}"
        )


def sweep_router(T=64, E=64, D=2048) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    wt = torch.randn(E, D, device="cuda", generator=g) / D**0.5
    exact = x.double() @ wt.double().t()
    ref = torch.nn.functional.linear(x.float(), wt)
    base = bench(lambda: torch.nn.functional.linear(x.float(), wt))
    print(
        f"ROUTER T={T}: torch cast + float32 GEMM {base:.4f} ms, max err vs float64 "
        f"{(ref.double() - exact).abs().max().item():.1e}",
        flush=True,
    )
    for be, bd, warps in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8)):
        out = torch.empty(T, E, dtype=torch.float32, device="cuda")

        def gemv():
            rt._router_logits_kernel[(triton.cdiv(E, be), T)](
                x, wt, out, E, D, x.stride(0), wt.stride(0), out.stride(0), BLOCK_E=be, BLOCK_D=bd, num_warps=warps
            )

        ms = bench(gemv)
        print(
            f"  gemv be={be} bd={bd} w={warps}: {ms:.4f} ms ({base / ms:.2f}x) err "
            f"{(out.double() - exact).abs().max().item():.1e}"
        )
    for bt_, warps, stages in itertools.product((16, 32, 64), (2, 4, 8), (2, 3, 4)):
        try:
            out = rt.router_gemm(x, wt, block_t=bt_, num_warps=warps, num_stages=stages)
            ms = bench(lambda: rt.router_gemm(x, wt, block_t=bt_, num_warps=warps, num_stages=stages))
        except Exception as exc:
            print(f"  tiled bt={bt_} w={warps} s={stages}: {type(exc).__name__}")
            continue
        print(
            f"  tiled bt={bt_} w={warps} s={stages}: {ms:.4f} ms ({base / ms:.2f}x) err "
            f"{(out.double() - exact).abs().max().item():.1e}"
        )


def sweep_align(T=64, E=64, k=6) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    flat = ids.reshape(-1).to(torch.int32)
    n = flat.numel()
    bm = 16
    cap = -(-(n + E * (bm - 1)) // bm) * bm
    ref = fm.moe_align(ids, E, bm)
    print(f"ALIGN rows={n}: default {bench(lambda: fm.moe_align(ids, E, bm)):.4f} ms", flush=True)
    for chunk, warps, fill in itertools.product((64, 128, 256, 512), (4, 8, 16), (1024, 2048)):
        s = torch.empty(cap, dtype=torch.int32, device="cuda")
        be = torch.empty(cap // bm, dtype=torch.int32, device="cuda")
        tot = torch.empty(1, dtype=torch.int32, device="cuda")
        cnt = torch.empty(E, dtype=torch.long, device="cuda")

        def run():
            fm._align_kernel[(1,)](
                flat, s, be, tot, cnt, n, cap, E, BLOCK_M=bm, E_P=64, CHUNK=chunk, FILL=fill, num_warps=warps
            )

        try:
            ms = bench(run)
        except Exception as exc:
            print(f"  chunk={chunk} w={warps} fill={fill}: {type(exc).__name__}")
            continue
        ok = torch.equal(s, ref.sorted_rows) and torch.equal(be, ref.block_expert) and torch.equal(tot, ref.total)
        print(f"  chunk={chunk} w={warps} fill={fill}: {ms:.4f} ms same={ok}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="moe,attn,router,align")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), triton.__version__)
    for part in args.only.split(","):
        {"moe": sweep_moe, "attn": sweep_attn, "router": sweep_router, "align": sweep_align}[part]()


if __name__ == "__main__":
    main()

"""The dense FP8 GEMMs of one V3-mini decode step on a GPU: the cuda_sm100 GEMV (``fp8_gemv``)
against the tiled FP8 GEMM it replaces for few rows (``fp8_gemm``), both as the decode graph runs
them (the step's 48 launches, each layer its own weights, captured in one CUDA graph, summed in
the same launch with arrival counters), plus a config sweep of the GEMV at one row.

Per shape: the median replay time of a graph of that shape's launches across the layers, over
the bytes read (weights + scales); per step: the graph of all 48 in the model's order. Every
variant's result is checked against the float64 product of e4m3 activations and dequantized
weights (relative error) before it is timed. Prints the copy bandwidth of the same run as the
peer: a 1 GiB device-to-device copy (bytes read + written).

    python benchmarks/kernels/fp8_gemv.py [--rows 1,2,4,8,16] [--sweep]
"""

from __future__ import annotations

import argparse

import graph_timing  # this folder (run as a script)
import torch
import triton

from deepinfer_cuda_sm100.kernels import fp8_gemv as gemv_module
from deepinfer_cuda_sm100.kernels.fp8_gemm import SplitCounters, fp8_linear
from deepinfer_cuda_sm100.kernels.fp8_gemv import GemvConfig

# V3-mini (hidden 2048, MLA q_lora 1536 / kv_lora 512 + rope 64 / 16 heads x (128 + 64) / v 128,
# shared expert 1024, dense layer 9216): (name, N, K, layers)
SHAPES = [
    ("q_a", 1536, 2048, 8),
    ("kv_a", 576, 2048, 8),
    ("q_b", 3072, 1536, 8),
    ("o", 2048, 2048, 8),
    ("shared gate_up", 2048, 2048, 7),
    ("shared down", 2048, 1024, 7),
    ("dense gate_up", 18432, 2048, 1),
    ("dense down", 2048, 9216, 1),
]


DEVICE = "cuda"


def weights(g):
    out = {}
    for name, n, k, layers in SHAPES:
        out[name] = [
            (
                (torch.randn(n, k, device=DEVICE, generator=g) * 2).to(torch.float8_e4m3fn),
                torch.rand(-(-n // 128), -(-k // 128), device=DEVICE, generator=g) * 0.02 + 0.001,
            )
            for _ in range(layers)
        ]
    return out


def graph_ms(fn) -> float:
    return graph_timing.graph_ms(fn, DEVICE)  # NaN under --dry (DEVICE cpu)


def rel_err(got, x, w, s) -> float:
    k = x.shape[1]
    grp = torch.nn.functional.pad(x.double(), (0, -k % 128)).view(x.shape[0], -1, 128)
    sc = (grp.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0).float().double()
    xq = ((grp / sc).float().to(torch.float8_e4m3fn).double() * sc).view(x.shape[0], -1)[:, :k]
    full = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    want = xq @ (w.double() * full).t()
    return ((got.double() - want).norm() / want.norm()).item()


def run(variant, ws, xs, counters, cfg=None, names=None):
    """Every launch of the chosen shapes (all by default), in the step's order."""
    outs = []
    for name, *_ in SHAPES:
        if names is not None and name not in names:
            continue
        for w, s in ws[name]:
            x = xs[w.shape[1]]
            if variant == "tiled":
                outs.append(fp8_linear_tiled(x, w, s, counters))
            else:
                out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                outs.append(gemv_module.fp8_gemv(x, w, s, out, counters, cfg or GemvConfig()))
    return outs


def fp8_linear_tiled(x, w, s, counters):
    saved, gemv_module.GEMV_ROWS = gemv_module.GEMV_ROWS, 0
    try:
        return fp8_linear(x, w, s, counters=counters)
    finally:
        gemv_module.GEMV_ROWS = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--sweep", action="store_true", help="GEMV configs at one row")
    ap.add_argument(
        "--shape-sweep", action="store_true", help="GEMV configs per shape at one row (slab shape, warps, K splits)"
    )
    ap.add_argument(
        "--dry", action="store_true", help="CPU, Triton's interpreter, shapes / 16, one layer each: checks the script"
    )
    args = ap.parse_args()
    if args.dry:
        global DEVICE
        DEVICE = "cpu"
        SHAPES[:] = [(name, max(n // 16, 36), max(k // 16, 128), 1) for name, n, k, _ in SHAPES]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ws = weights(g)
    step_bytes = sum(w.numel() + s.numel() * 4 for v in ws.values() for w, s in v)
    buf = torch.empty(1 << (20 if args.dry else 30), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(buf)
    copy_ms = (
        float("nan")
        if args.dry
        else triton.testing.do_bench(lambda: dst.copy_(buf), warmup=10, rep=100, return_mode="median")
    )
    bw = 2 * buf.numel() / copy_ms / 1e9
    buf = dst = None  # free the 1 GiB pair (rebinding, not del: the timing lambda names them)
    print(
        f"copy bandwidth (read + write) {bw:.2f} TB/s; step weights {step_bytes / 1e6:.1f} MB, read floor "
        f"{step_bytes / bw / 1e9:.4f} ms"
    )
    counters = SplitCounters()
    print("\n| rows | variant | step graph ms | TB/s | max rel err |")
    print("|---:|---|---:|---:|---:|")
    for m in [int(v) for v in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, device=DEVICE, generator=g).bfloat16() for k in {k for _, _, k, _ in SHAPES}}
        for variant in ("tiled", "gemv"):
            outs = run(variant, ws, xs, counters)
            flat = [(w, s) for name, *_ in SHAPES for w, s in ws[name]]
            err = max(rel_err(o, xs[w.shape[1]], w, s) for o, (w, s) in zip(outs, flat))
            ms = graph_ms(lambda: run(variant, ws, xs, counters))
            print(f"| {m} | {variant} | {ms:.4f} | {step_bytes / ms / 1e9:.2f} | {err:.1e} |", flush=True)
    xs = {k: torch.randn(1, k, device=DEVICE, generator=g).bfloat16() for k in {k for _, _, k, _ in SHAPES}}
    print("\n1 row, per shape (graph of that shape's launches over the layers):")
    print("| shape | N x K | launches | tiled ms | gemv ms | tiled / gemv | gemv TB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, n, k, layers in SHAPES:
        nbytes = sum(w.numel() + s.numel() * 4 for w, s in ws[name])
        t = graph_ms(lambda: run("tiled", ws, xs, counters, names={name}))
        v = graph_ms(lambda: run("gemv", ws, xs, counters, names={name}))
        print(
            f"| {name} | {n} x {k} | {layers} | {t:.4f} | {v:.4f} | {t / v:.2f}x | {nbytes / v / 1e9:.2f} |", flush=True
        )
    moe(g, bw)
    if args.shape_sweep:
        shape_sweep(ws, xs, counters)
    if args.sweep:
        print("\n1 row, GEMV configs (whole step graph):")
        print("| block_n | groups | warps | target programs | step ms | TB/s | max rel err |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        rows = []
        for bn, grp, warps, target in [
            (16, 4, 4, 528), (8, 4, 4, 528), (32, 4, 4, 528), (16, 2, 4, 528), (16, 8, 8, 528),
            (16, 4, 4, 264), (16, 4, 4, 1056), (16, 4, 8, 2112), (32, 2, 4, 1056),
        ]:  # fmt: skip
            cfg = GemvConfig(bn, grp, warps, target)
            try:
                outs = run("gemv", ws, xs, counters, cfg)
                flat = [(w, s) for name, *_ in SHAPES for w, s in ws[name]]
                err = max(rel_err(o, xs[w.shape[1]], w, s) for o, (w, s) in zip(outs, flat))
                ms = graph_ms(lambda: run("gemv", ws, xs, counters, cfg))
            except Exception as exc:  # out of registers / resources for this config
                print(f"| {bn} | {grp} | {warps} | {target} | failed: {type(exc).__name__} | | |")
                continue
            rows.append((ms, cfg, err))
            print(
                f"| {bn} | {grp} | {warps} | {target} | {ms:.4f} | {step_bytes / ms / 1e9:.2f} | {err:.1e} |",
                flush=True,
            )
        best = min(rows, key=lambda r: r[0])
        print(f"fastest: {best[1]} {best[0]:.4f} ms")


def shape_sweep(ws, xs, counters) -> None:
    """Per shape at one row: (block_n, groups, warps) slabs with the default K splits and with
    none (no second pass over partial sums, fewer dependent steps per launch)."""
    print("\n1 row, GEMV configs per shape (graph of that shape's launches over the layers), ms:")
    slabs = [(16, 8, 8), (8, 16, 8), (4, 16, 4), (2, 16, 4), (16, 4, 4), (4, 8, 4), (8, 8, 4)]
    print("| shape | " + " | ".join(f"{b}x{g}w{w} auto / 1" for b, g, w in slabs) + " |")
    print("|---|" + "---:|" * len(slabs))
    for name, n, k, layers in SHAPES:
        cells = []
        for b, grp, warps in slabs:
            times = []
            for split in (0, 1):
                cfg = GemvConfig(b, grp, warps, 528, split)
                try:
                    times.append(f"{graph_ms(lambda: run('gemv', ws, xs, counters, cfg, names={name})):.4f}")
                except Exception as exc:  # resources
                    times.append(type(exc).__name__)
            cells.append(" / ".join(times))
        print(f"| {name} {n}x{k} | " + " | ".join(cells) + " |", flush=True)


def moe(g, bw) -> None:
    """V3-mini's routed experts at one token (64 experts, top-6, hidden 2048, width 1024), FP8
    and bf16: ``fused_moe``'s default (the per-row GEMVs) vs the grouped GEMMs it used before (the
    tiling choose_config + the FP8 rule pick for 6 rows), 7 layers in one graph."""
    from deepinfer_cuda_sm100.kernels.fused_moe import MoEConfig, fused_moe

    E, k, D, I, layers = (64, 6, 2048, 1024, 7) if DEVICE == "cuda" else (8, 6, 256, 128, 1)
    print("\nMoE experts, 1 token (6 rows), 7 layers in one graph:")
    print("| experts | gemv ms | grouped GEMMs ms | grouped / gemv | gemv TB/s | rel diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for fp8 in (True, False):
        x = torch.randn(1, D, device=DEVICE, generator=g).bfloat16()
        ids = torch.randperm(E, device=DEVICE, generator=g)[:k].view(1, k).int()
        w = torch.rand(1, k, device=DEVICE, generator=g)
        mats = []
        for _ in range(layers):
            gu = torch.randn(E, 2 * I, D, device=DEVICE, generator=g) / D**0.5
            dn = torch.randn(E, D, I, device=DEVICE, generator=g) / I**0.5
            if fp8:
                sc = dict(
                    gate_up_scale=torch.rand(E, 2 * I // 128, D // 128, device=DEVICE, generator=g) / 64,
                    down_scale=torch.rand(E, D // 128, I // 128, device=DEVICE, generator=g) / 64,
                )
                mats.append(((gu * 64).to(torch.float8_e4m3fn), (dn * 64).to(torch.float8_e4m3fn), sc))
            else:
                mats.append((gu.bfloat16(), dn.bfloat16(), {}))
            del gu, dn
        tiled_cfg = MoEConfig(16, 32, 128, 4, 3) if fp8 else MoEConfig(16, 64, 64, 4, 3)
        run_moe = lambda cfg: [fused_moe(x, gu, dn, ids, w, None, cfg, **sc)[0] for gu, dn, sc in mats]  # noqa: E731, F821 (mats is deleted after this timing)
        a, b = run_moe(None), run_moe(tiled_cfg)
        diff = max(((p.float() - q.float()).norm() / q.float().norm()).item() for p, q in zip(a, b))
        nbytes = layers * k * 3 * I * D * (1 if fp8 else 2)
        t_gemv, t_tiled = graph_ms(lambda: run_moe(None)), graph_ms(lambda: run_moe(tiled_cfg))
        print(
            f"| {'FP8' if fp8 else 'bf16'} | {t_gemv:.4f} | {t_tiled:.4f} | {t_tiled / t_gemv:.2f}x | "
            f"{nbytes / t_gemv / 1e9:.2f} | {diff:.1e} |",
            flush=True,
        )
        from deepinfer_cuda_sm100.kernels import moe_gemv

        saved = moe_gemv.BLOCK_N
        for bn in (4, 8, 32):  # the GEMVs' column slab
            moe_gemv.BLOCK_N = bn
            print(f"|   BLOCK_N {bn} | {graph_ms(lambda: run_moe(None)):.4f} | | | | |", flush=True)
        moe_gemv.BLOCK_N = saved
        del mats


if __name__ == "__main__":
    main()

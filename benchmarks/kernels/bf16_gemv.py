"""The bf16 projections of one V3-mini decode step on a GPU: the cuda_sm100 16-bit GEMV
(``kernels/bf16_gemv``) against cuBLAS (``F.linear`` / ``torch.einsum``, what the step ran
before), as the decode graph runs them (each layer its own weights, captured in one CUDA graph).

Per shape: the median replay time of a graph of that shape's launches over its layers, over the
bytes read; per step: the graph of every launch in the model's order (cuBLAS with q_a and kv_a
separate, the GEMV with the two in one launch, as fused_ops.install stores them). Each result is
checked against the float64 product of the same bf16 operands before it is timed. The copy
bandwidth of the same run (1 GiB device-to-device, read + write) is the peer for the rates.

    python benchmarks/kernels/bf16_gemv.py [--rows 1,2] [--sweep] [--dry]
"""

from __future__ import annotations

import argparse

import graph_timing  # this folder (run as a script)
import torch
import torch.nn.functional as F
import triton

from deepinfer_core.fused_ops import rms_norm_reference
from deepinfer_cuda_sm100.kernels import bf16_gemv as gm
from deepinfer_cuda_sm100.kernels.fp8_gemm import SplitCounters
from deepinfer_cuda_sm100.kernels.fused_elementwise import rms_norm

# V3-mini: (name, N, K, layers) dense; MLA heads 16, nope 128, v 128, latent 512
DENSE = [("q_a+kv_a", 2112, 2048, 8), ("q_a", 1536, 2048, 8), ("kv_a", 576, 2048, 8), ("q_b", 3072, 1536, 8),
         ("o", 2048, 2048, 8), ("dense gate_up", 18432, 2048, 1), ("dense down", 2048, 9216, 1)]  # fmt: skip
HEADS = (16, 128, 128, 512, 8)  # H, nope, v, latent, layers
DEVICE = "cuda"


def graph_ms(fn) -> float:
    return graph_timing.graph_ms(fn, DEVICE)  # NaN under --dry (DEVICE cpu)


def rel(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def main() -> None:
    global DEVICE
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--sweep", action="store_true", help="GEMV configs per shape at one row")
    ap.add_argument("--dry", action="store_true", help="CPU, Triton's interpreter, small shapes: checks the script")
    args = ap.parse_args()
    H, n, v, C, hl = HEADS
    if args.dry:
        DEVICE = "cpu"
        DENSE[:] = [(name, max(N // 32, 24), max(K // 32, 64), 1) for name, N, K, _ in DENSE]
        H, n, v, C, hl = 2, 16, 16, 64, 1
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ws = {
        name: [torch.randn(N, K, device=DEVICE, generator=g).bfloat16() / K**0.5 for _ in range(layers)]
        for name, N, K, layers in DENSE
    }
    kvb = [torch.randn(H, n + v, C, device=DEVICE, generator=g).bfloat16() / C**0.5 for _ in range(hl)]
    buf = torch.empty(1 << (20 if args.dry else 30), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(buf)
    copy_ms = (
        float("nan")
        if args.dry
        else triton.testing.do_bench(lambda: dst.copy_(buf), warmup=10, rep=100, return_mode="median")
    )
    bw = 2 * buf.numel() / copy_ms / 1e9
    buf = dst = None  # free the 1 GiB pair (rebinding, not del: the timing lambda names them)
    print(f"copy bandwidth (read + write) {bw:.2f} TB/s")
    counters = SplitCounters()

    def dense(name, x, cfg=None, cublas=False):
        return [F.linear(x, w) if cublas else gm.dense_linear(x, w, counters, cfg) for w in ws[name]]

    def uk(xq, cublas=False, cfg=None):  # q_nope [T, H, n] -> [T, H, C]
        if cublas:
            return [torch.einsum("thn,hnc->thc", xq, w[:, :n]) for w in kvb]
        return [_heads(xq, w[:, :n].transpose(1, 2), cfg or gm.HEADS_N) for w in kvb]

    def uv(xl, cublas=False, cfg=None):  # latent [T, H, C] -> [T, H, v]
        if cublas:
            return [torch.einsum("thc,hvc->thv", xl, w[:, n:]) for w in kvb]
        return [_heads(xl, w[:, n:], cfg or gm.HEADS_K) for w in kvb]

    for m in [int(r) for r in args.rows.split(",")]:
        xs = {K: torch.randn(m, K, device=DEVICE, generator=g).bfloat16() for K in {K for _, _, K, _ in DENSE}}
        xq = torch.randn(m, H, n + 64, device=DEVICE, generator=g).bfloat16()[..., :n]
        xl = torch.randn(m, H, C, device=DEVICE, generator=g).bfloat16()
        print(f"\n{m} row(s), per shape (graph of that shape's launches over its layers):")
        print("| shape | N x K | launches | cuBLAS ms | gemv ms | cuBLAS / gemv | gemv TB/s | gemv rel err |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for name, N, K, layers in DENSE:
            got = dense(name, xs[K])
            err = max(rel(o, xs[K].double() @ w.double().t()) for o, w in zip(got, ws[name]))
            t = graph_ms(lambda: dense(name, xs[K], cublas=True))
            e = graph_ms(lambda: dense(name, xs[K]))
            print(
                f"| {name} | {N} x {K} | {layers} | {t:.4f} | {e:.4f} | {t / e:.2f}x | "
                f"{N * K * 2 * layers / e / 1e9:.2f} | {err:.1e} |",
                flush=True,
            )
        qn = (torch.rand(_k("q_b"), device=DEVICE, generator=g) + 0.5).bfloat16()
        qa = torch.randn(m, _k("q_b"), device=DEVICE, generator=g).bfloat16() * 3
        got = [gm.dense_linear(qa, w, counters, norm=(qn, 1e-6)) for w in ws["q_b"]]
        err = max(rel(o, rms_norm_reference(qa, qn, 1e-6).double() @ w.double().t()) for o, w in zip(got, ws["q_b"]))
        t = graph_ms(lambda: [F.linear(rms_norm(qa, qn, 1e-6), w) for w in ws["q_b"]])
        e = graph_ms(lambda: [gm.dense_linear(qa, w, counters, norm=(qn, 1e-6)) for w in ws["q_b"]])
        print(
            f"| q_b with q_a's norm (norm kernel + cuBLAS vs one GEMV) | 3072 x 1536 | 8 | {t:.4f} | {e:.4f} | "
            f"{t / e:.2f}x | | {err:.1e} |",
            flush=True,
        )
        for label, fn, x, nbytes in (
            ("W_UK (heads, N contiguous)", uk, xq, H * n * C * 2),
            ("W_UV (heads)", uv, xl, H * v * C * 2),
        ):
            got = fn(x)
            ref = [torch.einsum(*_eq(fn), x.double(), w.double()) for w in _views(fn, kvb, n)]
            err = max(rel(o, r) for o, r in zip(got, ref))
            t = graph_ms(lambda: fn(x, cublas=True))
            e = graph_ms(lambda: fn(x))
            print(
                f"| {label} | {H} x {'C x n' if fn is uk else 'v x C'} | {hl} | {t:.4f} | {e:.4f} | {t / e:.2f}x | "
                f"{nbytes * hl / e / 1e9:.2f} | {err:.1e} |",
                flush=True,
            )

        def step(cublas):  # the model's order: q_a + kv_a, q_b, W_UK, W_UV, o per layer; the dense MLP
            lin = F.linear if cublas else (lambda x, w: gm.dense_linear(x, w, counters))
            for i in range(hl):
                if cublas:
                    F.linear(xs[_k("q_a")], ws["q_a"][i]), F.linear(xs[_k("kv_a")], ws["kv_a"][i])
                else:
                    lin(xs[_k("q_a+kv_a")], ws["q_a+kv_a"][i])
                if cublas:
                    F.linear(rms_norm(qa, qn, 1e-6), ws["q_b"][i])
                else:
                    gm.dense_linear(qa, ws["q_b"][i], counters, norm=(qn, 1e-6))
                w = kvb[i]
                if cublas:
                    torch.einsum("thn,hnc->thc", xq, w[:, :n]), torch.einsum("thc,hvc->thv", xl, w[:, n:])
                else:
                    _heads(xq, w[:, :n].transpose(1, 2), gm.HEADS_N), _heads(xl, w[:, n:], gm.HEADS_K)
                lin(xs[_k("o")], ws["o"][i])
            for name in ("dense gate_up", "dense down"):
                lin(xs[_k(name)], ws[name][0])

        step_bytes = sum(
            w.numel() * 2 for name in ("q_a+kv_a", "q_b", "o", "dense gate_up", "dense down") for w in ws[name]
        ) + sum(w.numel() * 2 for w in kvb)
        t, e = graph_ms(lambda: step(True)), graph_ms(lambda: step(False))
        print(
            f"| whole step ({m} row) | {step_bytes / 1e6:.1f} MB | | {t:.4f} | {e:.4f} | {t / e:.2f}x | "
            f"{step_bytes / e / 1e9:.2f} | |"
        )
        print(f"read floor at the copy rate: {step_bytes / bw / 1e9:.4f} ms")
        if args.sweep and m == 1:
            sweep(dense, uk, uv, xs, xq, xl)


def _k(name: str) -> int:
    return next(K for nm, _, K, _ in DENSE if nm == name)


def _eq(fn):
    return ("thn,hnc->thc",) if fn.__name__ == "uk" else ("thc,hvc->thv",)


def _views(fn, kvb, n):
    return [w[:, :n] for w in kvb] if fn.__name__ == "uk" else [w[:, n:] for w in kvb]


def _heads(x, w, cfg):
    """head_linear with a chosen config (the module's picks HEADS_K / HEADS_N by stride)."""
    T, H, K = x.shape
    out = torch.empty(T, H, w.shape[1], dtype=x.dtype, device=x.device)
    xs = x.transpose(0, 1)
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    gm.gemv(xs, w, out.transpose(0, 1), None, cfg)
    return out


def sweep(dense, uk, uv, xs, xq, xl) -> None:
    """One row: slab shapes, warps and K-split targets per shape (ms, graph over the layers)."""
    cfgs = [
        gm.Bf16GemvConfig(bn, bk, w, t, sp)
        for bn, bk, w, t, sp in [
            (16, 512, 4, 528, 0),
            (4, 1024, 4, 1056, 0),
            (1, 1024, 4, 1056, 1),
            (2, 1024, 8, 1056, 1),
            (2, 512, 4, 1056, 1),
            (4, 1024, 8, 1056, 1),
            (4, 512, 4, 1056, 1),
            (8, 512, 8, 1056, 1),
            (16, 1024, 8, 1056, 1),
            (1, 2048, 8, 1056, 1),
            (2, 1024, 4, 1056, 1),
            (2, 1024, 8, 1056, 2),
        ]
    ]
    print("\n1 row, GEMV configs per shape (block_n x block_k, warps, target programs), ms:")
    print(
        "| shape | auto | "
        + " | ".join(f"{c.block_n}x{c.block_k} w{c.warps} s{c.split or 't' + str(c.target_programs)}" for c in cfgs)
        + " | best |"
    )
    print("|---|" + "---:|" * (len(cfgs) + 2))
    for name, _, K, _ in DENSE:
        cells = []
        for c in cfgs:
            try:
                cells.append(graph_ms(lambda: dense(name, xs[K], c)))
            except Exception as exc:  # resources
                print(f"  {name} {c}: {type(exc).__name__}: {str(exc)[:100]}")
                cells.append(float("inf"))
        best = min(range(len(cfgs)), key=lambda i: cells[i])
        auto = graph_ms(lambda: dense(name, xs[K]))
        c = gm.dense_config(next(N for nm, N, _, _ in DENSE if nm == name), K)
        print(
            f"| {name} | {auto:.4f} ({c.block_n}x{c.block_k} w{c.warps}) | "
            + " | ".join(f"{v:.4f}" for v in cells)
            + f" | {cfgs[best]} |",
            flush=True,
        )
    hcfgs = [gm.Bf16GemvConfig(bn, bk, w, 528, s) for bn, bk, w, s in [
        (64, 128, 4, 1), (32, 128, 4, 1), (128, 128, 8, 1), (64, 128, 8, 1), (16, 128, 2, 1), (32, 128, 2, 1),
        (16, 512, 4, 1), (8, 512, 4, 1), (4, 512, 4, 1), (2, 512, 4, 1), (4, 512, 2, 1), (8, 512, 2, 1),
    ]]  # fmt: skip
    print("\n| heads | " + " | ".join(f"{c.block_n}x{c.block_k} w{c.warps}" for c in hcfgs) + " |")
    print("|---|" + "---:|" * len(hcfgs))
    for label, fn, x in (("W_UK^T", uk, xq), ("W_UV", uv, xl)):
        cells = []
        for c in hcfgs:
            try:
                cells.append(f"{graph_ms(lambda: fn(x, cfg=c)):.4f}")
            except Exception as exc:
                cells.append(type(exc).__name__)
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

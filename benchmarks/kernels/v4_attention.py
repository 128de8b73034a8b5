"""DeepSeek-V4 attention alone: the cuda_sm100 Triton kernels vs the core's torch reference
(``v4_ref``, what the plugin ran before) on the same inputs, in one run, per layer kind.

    python benchmarks/kernels/v4_attention.py                      # V4-mini shapes on a CUDA GPU
    python benchmarks/kernels/v4_attention.py --heads 64           # V4-Flash's 64 heads
    TRITON_INTERPRET=1 python benchmarks/kernels/v4_attention.py --tiny   # smoke run on a CPU (no timing value)

Rows: decode at 1 / 16 / 64 requests (context ``--context``), prefill of 4 x 512 new tokens
after a cached prefix. Each cell is the median of ``--reps`` timed calls after
warm-up (CUDA events); outputs of the two paths are compared (max abs diff) in the same run
(both see the same ring: each call rewrites it with the same keys).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
from deepinfer_core.attention.v4_ref import TorchV4AttentionBackend
from deepinfer_core.models.deepseek_v4.kv import V4LayerCache
from deepinfer_core.testing.paged_batch import scattered_batch


def case(kind, ratio, heads, D, window, topk, lens, new, dtype, device, block=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = len(lens)
    batch = scattered_batch(lens, new, block_size=block, generator=g)
    per_block = block // ratio if ratio else 0
    width = D + (128 if kind is AttentionKind.COMPRESSED_SPARSE else 0)
    cache = V4LayerCache(
        entries=(torch.randn(batch.num_blocks, per_block, width, generator=g) * 0.5).to(device, dtype),
        window=(torch.randn(R, window - 1, D, generator=g) * 0.5).to(device, dtype),
        tail=torch.zeros(R, 0, 0, device=device, dtype=dtype),
    )
    positions = batch.positions
    selected = None
    if kind is AttentionKind.COMPRESSED_SPARSE:
        rows = []
        for p in positions.tolist():
            vis = (p + 1) // ratio
            pick = torch.randperm(vis, generator=g)[:topk].tolist() if vis else []
            rows.append(pick + [-1] * (topk - len(pick)))
        selected = torch.tensor(rows, dtype=torch.long, device=device)
    # V4 keys go to the rings and entries, never to slot_mapping
    meta = batch.metadata(device, slot_mapping=torch.zeros_like(positions), state_slots=torch.arange(R, device=device))
    spec = AttentionLayerSpec(
        kind,
        0,
        heads,
        1,
        D,
        D,
        D**-0.5,
        rope_dim=64,
        kv_shared=True,
        window=window,
        compress_ratio=ratio,
        index_topk=topk if ratio == 4 else 0,
        kv_dtype=dtype,
        state_kv=True,
    )
    q = torch.randn(batch.num_tokens, heads, D, generator=g).to(device, dtype)
    kv = (torch.randn(batch.num_tokens, D, generator=g) * 0.5).to(device, dtype)
    sinks = torch.randn(heads, generator=g).to(device)
    return spec, q, kv, sinks, cache, meta, selected


def timed(fn, reps, device):
    for _ in range(3):
        out = fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run through the interpreter)")
    args = ap.parse_args()
    from deepinfer_cuda_sm100.attention import TritonV4Attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    D, window, topk, hca = (512, 128, 512, 128) if not args.tiny else (32, 16, 8, 16)
    ctx = args.context if not args.tiny else 96
    levels = [(1, 1), (16, 1), (64, 1), (4, 512)] if not args.tiny else [(1, 1), (3, 1), (2, 24)]
    ref, ours = TorchV4AttentionBackend(), TritonV4Attention()
    print(
        f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {dtype}, heads {args.heads}, head_dim "
        f"{D}, window {window}, context {ctx}"
    )
    print("| kind | requests x new tokens | reference ms | triton ms | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, kind, ratio in (
        ("sliding", AttentionKind.SLIDING, 0),
        ("csa", AttentionKind.COMPRESSED_SPARSE, 4),
        ("hca", AttentionKind.HEAVILY_COMPRESSED, hca),
    ):
        for R, new in levels:
            spec, q, kv, sinks, cache, meta, sel = case(
                kind, ratio, args.heads, D, window, topk, [ctx] * R, new, dtype, device
            )
            t_ref, o_ref = timed(lambda: ref.forward_v4(spec, q, kv, sinks, cache, meta, sel), args.reps, device)
            t_ours, o_ours = timed(lambda: ours.forward_v4(spec, q, kv, sinks, cache, meta, sel), args.reps, device)
            diff = (o_ref.float() - o_ours.float()).abs().max().item()
            print(f"| {name} | {R} x {new} | {t_ref:.3f} | {t_ours:.3f} | {t_ref / t_ours:.2f}x | {diff:.2e} |")


if __name__ == "__main__":
    main()

"""MLA prefill attention of one DeepSeek-V3 layer in three forms, on the same inputs, in one run:

* absorbed (what the cuda_sm100 plugin ran for every step before): queries multiplied into the
  latent (``W_UK``), the Triton paged kernel on the 576-wide latent, ``W_UV`` on its output;
* expanded (``TritonAttention.forward_mla_expanded`` minus the cache write): the context's
  latents decompressed through ``kv_b_proj``, then the new Triton kernel (192 / 128 wide heads);
* torch SDPA (flash) on the same decompressed keys / values, V padded to the query width
  (torch's flash kernel needs one head width), whole prompts of one length only.

    python benchmarks/kernels/mla_prefill.py                 # V3-mini widths (16 heads) on a CUDA GPU
    python benchmarks/kernels/mla_prefill.py --heads 128     # DeepSeek-V3's 128 heads
    TRITON_INTERPRET=1 python benchmarks/kernels/mla_prefill.py --tiny   # smoke run on a CPU (no timing value)

Rows: 64 x 512 whole prompts (gpu_throughput.py's prefill), 4 x 4,096, and a 2,048-token chunk
over a 6,144-token cached prefix. Each cell is the median of ``--reps`` timed calls after warm-up
(CUDA events); TFLOP/s counts the attention's own multiply-adds (causal pairs x heads x 2 x
(q/k width + v width): 1,088 absorbed, 320 expanded), not the decompression / absorption GEMMs
the times include. Outputs are compared with the absorbed form's (max abs diff).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
from deepinfer_core.testing.paged_batch import scattered_batch


def case(lens, new, heads, latent, rope, nope, v_dim, dtype, device, block=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = scattered_batch(lens, new, block_size=block, generator=g)
    cache = (torch.randn(1, 1, batch.num_blocks, block, latent + rope, generator=g) * 0.5).to(device, dtype)
    slots = batch.slot_mapping
    meta = batch.metadata(device, num_context_tokens=sum(lens))
    spec = AttentionLayerSpec(
        AttentionKind.MLA,
        0,
        heads,
        1,
        latent + rope,
        latent,
        (nope + rope) ** -0.5,
        rope_dim=rope,
        kv_shared=True,
        kv_dtype=dtype,
    )
    q = torch.randn(batch.num_tokens, heads, nope + rope, generator=g).to(device, dtype)
    key = cache.view(-1, latent + rope)[slots.to(device)][:, None, :]
    w_kv = (torch.randn(heads, nope + v_dim, latent, generator=g) / latent**0.5).to(device, dtype)
    return spec, q, key, w_kv, cache, meta, batch.num_attention_pairs


def absorbed(spec, q, w_kv, cache, meta, nope):
    from deepinfer_cuda_sm100.kernels.paged_attention import paged_attention

    query = torch.cat([torch.einsum("thn,hnc->thc", q[..., :nope], w_kv[:, :nope]), q[..., nope:]], dim=-1)
    lat = paged_attention(
        query,
        cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        scale=spec.scale,
        v_head_dim=spec.v_head_dim,
        kv_shared=True,
    )
    return torch.einsum("thc,hvc->thv", lat, w_kv[:, nope:])


def expanded(spec, q, key, w_kv, cache, meta):
    from deepinfer_cuda_sm100.mla_expanded import expanded_attention

    return expanded_attention(spec, q, key, w_kv, cache, meta)


def sdpa(spec, q, key, w_kv, meta, nope, R, L):
    """Whole prompts of one length ``L``: decompress, pad V to the query width, flash SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, nv, C = w_kv.shape
    kv = F.linear(key[:, 0, :C], w_kv.reshape(H * nv, C)).view(R, L, H, nv)
    k = torch.cat([kv[..., :nope], key[:, :, C:].view(R, L, 1, -1).expand(R, L, H, -1)], dim=-1)
    v = F.pad(kv[..., nope:], (0, q.shape[-1] - (nv - nope)))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(
            q.view(R, L, H, -1).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=spec.scale
        )
    return out.transpose(1, 2).reshape(R * L, H, -1)[..., : nv - nope]


def timed(fn, reps, device):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


SWEEP = [
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 64, 4, 2),
    (128, 32, 4, 2),
    (128, 32, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 32, 4, 2),
]


def sweep(spec, q, key, w_kv, cache, meta, nope, flop, reps, device):
    """The Triton kernel alone (keys already decompressed) at each tile shape of SWEEP."""
    from deepinfer_cuda_sm100.kernels.mla_prefill import PrefillConfig, mla_prefill_attention
    from deepinfer_cuda_sm100.mla_expanded import context_entries

    H, nv, C = w_kv.shape
    entries, key_start = context_entries(spec, key, cache, meta)
    kv = F.linear(entries[:, :C], w_kv.reshape(H * nv, C)).view(-1, H, nv)
    cells = []
    for bm, bn, warps, stages in SWEEP:
        cfg = PrefillConfig(bm, bn, warps, stages)

        def run():
            return mla_prefill_attention(
                q,
                kv[..., :nope],
                entries[:, C:],
                kv[..., nope:],
                meta.query_start_loc,
                key_start,
                meta.seq_lens,
                max_query_len=meta.max_query_len,
                scale=spec.scale,
                config=cfg,
            )

        try:
            ms = timed(run, reps, device)
            cells.append(f"{bm}x{bn} w{warps} s{stages}: {ms:.3f} ms {flop / ms / 1e9:.0f} TFLOP/s")
        except Exception as e:  # e.g. out of shared memory at this shape
            cells.append(f"{bm}x{bn} w{warps} s{stages}: failed ({type(e).__name__})")
    print("  kernel alone: " + "; ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter smoke run)")
    ap.add_argument("--sweep", action="store_true", help="also time the expanded kernel alone at several tile shapes")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.tiny:
        heads, latent, rope, nope, v_dim = 2, 32, 16, 16, 16
        rows = [("2 x 40", [40] * 2, [40] * 2), ("1 x 20 after 30", [50], [20])]
    else:
        heads, latent, rope, nope, v_dim = args.heads, 512, 64, 128, 128
        rows = [
            ("64 x 512", [512] * 64, [512] * 64),
            ("4 x 4096", [4096] * 4, [4096] * 4),
            ("2048 after 6144", [8192], [2048]),
        ]
    print(
        f"MLA prefill attention, one layer: {heads} heads, latent {latent}, rope {rope}, nope {nope}, v {v_dim}, "
        f"{dtype}, {device}"
    )
    if device == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(
        "| shape | absorbed ms | expanded ms | SDPA flash ms | expanded TFLOP/s (attention only) | absorbed TFLOP/s | "
        "absorbed / expanded | max diff expanded | max diff SDPA |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, lens, new in rows:
        spec, q, key, w_kv, cache, meta, pairs = case(lens, new, heads, latent, rope, nope, v_dim, dtype, device)
        ref = absorbed(spec, q, w_kv, cache, meta, nope)
        out = expanded(spec, q, key, w_kv, cache, meta)
        t_abs = timed(lambda: absorbed(spec, q, w_kv, cache, meta, nope), args.reps, device)
        t_exp = timed(lambda: expanded(spec, q, key, w_kv, cache, meta), args.reps, device)
        sd, d_sd = "n/a", "n/a"
        if lens == new and len(set(lens)) == 1:
            try:
                o_sd = sdpa(spec, q, key, w_kv, meta, nope, len(lens), lens[0])
                d_sd = f"{(o_sd.float() - ref.float()).abs().max().item():.2e}"
                sd = f"{timed(lambda: sdpa(spec, q, key, w_kv, meta, nope, len(lens), lens[0]), args.reps, device):.3f}"
            except RuntimeError as e:  # no flash kernel for these widths / this device
                sd = f"n/a ({str(e).splitlines()[0][:60]})"
        flop_exp = pairs * heads * 2 * (nope + rope + v_dim)
        flop_abs = pairs * heads * 2 * (latent + rope + latent)
        print(f"| {name} | {t_abs:.3f} | {t_exp:.3f} | {sd} | {flop_exp / t_exp / 1e9:.1f} | "
              f"{flop_abs / t_abs / 1e9:.1f} | {t_abs / t_exp:.2f}x | "
              f"{(out.float() - ref.float()).abs().max().item():.2e} | {d_sd} |")  # fmt: skip
        if args.sweep:
            sweep(spec, q, key, w_kv, cache, meta, nope, flop_exp, args.reps, device)
        spec = q = key = w_kv = cache = meta = ref = out = None  # free them before the next shape
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

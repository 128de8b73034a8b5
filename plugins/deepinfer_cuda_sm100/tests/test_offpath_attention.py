"""The Triton paged attention (``TritonAttention.forward``: the K/V write and the attention, with
the launch configuration the plugin picks itself) on shapes no other test uses, against the
core's torch reference run in float64 on the same cache: head widths that are not powers of two
or narrower than a tensor-core tile, GQA ratios 1-8 and MQA, head counts that are not powers of
two, requests of mixed prompt and cached-prefix lengths in one batch, prefixes that end inside a
block, sliding windows shorter and longer than the context, and decode contexts on both sides of
the block and split-KV thresholds.

Hypothesis draws the small cases for Triton's interpreter (CI); the GPU variants (skipped
without CUDA) take the sizes of real models and batches.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec, AttentionMetadata  # noqa: E402
from deepinfer_core.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from deepinfer_core.testing.paged_batch import scattered_batch  # noqa: E402
from deepinfer_cuda_sm100.attention import TritonAttention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(
    not CUDA, reason="the GPU variant needs a CUDA device (the interpreter runs the small cases)"
)


def spec_of(
    kind: str, heads: int, kv_heads: int, head_dim: int, window: int | None = None, v_dim: int | None = None
) -> AttentionLayerSpec:
    """A layer spec: ``mla`` is one latent KV head with V the first ``v_dim`` channels of K."""
    if kind == "mla":
        return AttentionLayerSpec(
            AttentionKind.MLA,
            0,
            heads,
            1,
            head_dim,
            v_dim or head_dim - 16,
            scale=head_dim**-0.5,
            rope_dim=16,
            kv_shared=True,
        )
    k = AttentionKind.SLIDING if window is not None else AttentionKind.FULL
    return AttentionLayerSpec(k, 0, heads, kv_heads, head_dim, head_dim, scale=head_dim**-0.5, window=window)


def run_case(spec, cached, new, *, block_size, dtype, seed=0, spare_blocks=3):
    """Requests with ``cached[r]`` tokens already in the cache and ``new[r]`` tokens this step,
    their blocks shuffled over a cache of random contents. Returns (ours, float64 reference,
    our cache, the reference's cache)."""
    g = torch.Generator().manual_seed(seed)
    batch = scattered_batch(
        [c + n for c, n in zip(cached, new)], new, block_size=block_size, generator=g, spare_blocks=spare_blocks
    )
    ref = TorchAttentionBackend()
    cache = torch.randn(ref.kv_cache_shape(spec, batch.num_blocks, block_size), generator=g)
    T = batch.num_tokens
    q = torch.randn(T, spec.num_heads, spec.head_dim, generator=g)
    k = torch.randn(T, spec.num_kv_heads, spec.head_dim, generator=g)
    v = torch.randn(T, spec.num_kv_heads, spec.v_head_dim, generator=g)
    ours_cache = cache.to(DEVICE, dtype)
    ours = TritonAttention().forward(
        spec, q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), ours_cache, batch.metadata(DEVICE)
    )
    ref_cache = cache.to(DEVICE, dtype).double()  # the cache's own rounding, then exact arithmetic
    want = ref.forward(spec, *(x.to(DEVICE, dtype).double() for x in (q, k, v)), ref_cache, batch.metadata(DEVICE))
    return ours, want, ours_cache, ref_cache


def check(spec, cached, new, *, block_size=16, dtype=torch.float32, seed=0):
    ours, want, ours_cache, ref_cache = run_case(spec, cached, new, block_size=block_size, dtype=dtype, seed=seed)
    assert ours.shape == want.shape and ours.dtype == dtype
    assert torch.equal(ours_cache.double(), ref_cache), "the K/V write differs from the reference's"
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), want, atol=3e-5, rtol=1e-4)
    else:
        err = ((ours.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"relative error {err:.2e}"


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["full", "sliding", "mla"]))
    if kind == "mla":
        head_dim = draw(st.sampled_from([24, 40, 48, 80]))  # latent + 16 rope channels
        heads, kv_heads, window = draw(st.integers(1, 10)), 1, None
    else:
        head_dim = draw(st.sampled_from([4, 8, 12, 16, 24, 40, 48, 80, 96]))
        kv_heads = draw(st.integers(1, 3))
        heads = kv_heads * draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
        window = draw(st.sampled_from([1, 3, 16, 17, 40, 500])) if kind == "sliding" else None
    spec = spec_of(kind, heads, kv_heads, head_dim, window)
    block_size = draw(st.sampled_from([16, 32]))
    R = draw(st.integers(1, 4))
    decode = draw(st.booleans())
    cached = draw(st.lists(st.integers(0, 70), min_size=R, max_size=R))
    new = [1] * R if decode else draw(st.lists(st.integers(1, 20), min_size=R, max_size=R))
    return spec, cached, new, block_size


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_shapes_match_the_float64_reference(case):
    spec, cached, new, block_size = case
    check(spec, cached, new, block_size=block_size)


@pytest.mark.parametrize("head_dim", [4, 8, 12], ids=lambda d: f"d{d}")
def test_heads_narrower_than_a_tensor_core_tile(head_dim):
    """head_dim < 16: ``tl.dot`` needs 16-wide operands on the GPU (the interpreter accepts any
    width), so the kernel pads the channels to 16 and masks them."""
    check(spec_of("full", 6, 2, head_dim), [0, 19, 33], [5, 1, 14], block_size=16)


@pytest.mark.parametrize("window", [1, 5, 16, 200], ids=lambda w: f"w{w}")
def test_sliding_window_shorter_and_longer_than_the_context(window):
    """Prefill over a cached prefix that ends mid-block, and decode, with the window's edge
    inside, on and beyond the context (window 1: each token sees only itself)."""
    spec = spec_of("full", 4, 2, 32, window=window)
    check(spec, [0, 21, 47], [33, 11, 1], block_size=16)
    check(spec, [30, 5, 64], [1, 1, 1], block_size=16)


@pytest.mark.parametrize("ctx", [1, 127, 128, 129, 300], ids=lambda c: f"ctx{c}")
def test_decode_at_block_and_split_boundaries_in_128_token_blocks(ctx):
    """The engine's 128-token blocks; 300 tokens crosses the split-KV threshold (256) of the
    plugin's own launch choice (3 requests: few programs, so the decode splits)."""
    check(spec_of("full", 3, 1, 16), [ctx - 1, max(0, ctx - 2), 0], [1, 1, 1], block_size=128)


def test_float32_mla_with_many_heads_runs_in_head_chunks():
    """float32 MLA (576 channels) at 40 heads: too wide for one program's shared memory on the
    GPU (DeepSeek-V3's 128 heads needed 451 KiB), so 16 + 16 + 8 heads in three launches."""
    from deepinfer_cuda_sm100.kernels.paged_attention import head_chunk

    assert head_chunk(40, 576, 512, 4, False) == 16 and head_chunk(16, 576, 512, 4, True) == 16
    spec = spec_of("mla", 40, 1, 576, v_dim=512)
    check(spec, [0, 20], [9, 1], block_size=16)
    check(spec, [30, 3], [1, 1], block_size=16)


def test_head_chunks_of_a_gqa_layer(monkeypatch):
    """The chunked launches of a GQA layer (2 KV heads x 6 query heads, runs of 4 + 2) read
    each KV head's slice of the cache."""
    from deepinfer_cuda_sm100.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "FLOAT32_TILE", 64)
    assert pa.head_chunk(6, 16, 16, 4, False) == 4
    check(spec_of("full", 12, 2, 16), [0, 17, 40], [6, 1, 3], block_size=16)


def test_bf16_split_kv_partials_too_wide_run_in_head_chunks(monkeypatch):
    """Split-KV partials are float32 and staged whole in shared memory: DeepSeek-V3's bf16 MLA
    (128 heads x 512) decoding with splits needed 256 KiB on the H200 (found by the GPU variant
    below), so it takes two launches of 64 heads; without splits (bf16 output) it stays one.
    Here the limit is lowered so a small layer takes the same path (decode over 300 tokens:
    2 splits)."""
    from deepinfer_cuda_sm100.kernels import paged_attention as pa

    assert pa.head_chunk(128, 576, 512, 2, True) == 64 and pa.head_chunk(128, 576, 512, 2, False) == 128
    monkeypatch.setattr(pa, "FLOAT32_OUT_TILE", 4 * 16 * 4)
    assert pa.head_chunk(6, 16, 16, 2, True) == 4 and pa.head_chunk(6, 16, 16, 2, False) == 6
    check(spec_of("full", 12, 2, 16), [299, 280], [1, 1], block_size=16, dtype=torch.bfloat16)


# -- GPU: real head widths, long contexts, large batches -----------------------------------


F32, B16 = torch.float32, torch.bfloat16


@gpu_only
@pytest.mark.parametrize(
    "kind,heads,kv_heads,head_dim,dtype",
    [("full", 32, 32, 64, F32), ("full", 28, 4, 128, F32), ("full", 28, 4, 128, B16), ("full", 32, 8, 80, F32),
     ("full", 12, 3, 96, F32), ("full", 16, 2, 256, F32), ("full", 16, 2, 256, B16), ("full", 71, 1, 64, F32),
     ("full", 9, 3, 8, F32), ("sliding", 40, 8, 128, F32), ("mla", 16, 1, 576, F32), ("mla", 128, 1, 576, F32),
     ("mla", 128, 1, 576, B16)],
    ids=lambda x: str(x).replace("torch.", ""),
)  # fmt: skip
def test_gpu_model_shapes_prefill_and_decode(kind, heads, kv_heads, head_dim, dtype):
    spec = spec_of(
        kind,
        heads,
        kv_heads,
        head_dim,
        window=1000 if kind == "sliding" else None,
        v_dim=512 if kind == "mla" else None,
    )
    check(
        spec, [0, 130, 4000, 77, 1], [300, 129, 97, 1, 128], block_size=128, dtype=dtype
    )  # mixed prompts, cached prefixes
    check(
        spec, [0, 126, 127, 128, 4094, 4096, 8191], [1] * 7, block_size=128, dtype=dtype
    )  # contexts 1, 127-129, 4095, 4097, 8192


@gpu_only
@pytest.mark.parametrize("batch", [1, 3, 17, 63, 65, 100, 257, 600])
def test_gpu_decode_batch_sizes(batch):
    g = torch.Generator().manual_seed(batch)
    cached = torch.randint(0, 3000, (batch,), generator=g).tolist()
    check(spec_of("full", 15, 3, 64), cached, [1] * batch, block_size=128)
    check(spec_of("mla", 16, 1, 576, v_dim=512), cached, [1] * batch, block_size=128, dtype=torch.bfloat16)


@gpu_only
def test_gpu_cache_plane_past_2_31_elements():
    """A layer cache whose KV-head offset passes 2^31 elements (a few-layer model whose default
    cache fills the GPU): the kernel's head offset is 64-bit (in int32 it wrapped)."""
    from deepinfer_cuda_sm100.kernels.paged_attention import paged_attention

    spec = spec_of("full", 6, 3, 64)
    blocks = (1 << 31) // (128 * 64) // 2 + 8  # 2 * stride(head) > 2^31
    cache = torch.zeros(1, 3, blocks, 128, 64, dtype=torch.bfloat16, device="cuda")  # K and V share a plane (6.4 GB)
    g = torch.Generator().manual_seed(0)
    used = torch.tensor([blocks - 1, 3, blocks - 5])
    small = torch.randn(1, 3, 3, 128, 64, generator=g).to(torch.bfloat16)
    cache[:, :, used.cuda()] = small.cuda()
    q = torch.randn(2, 6, 64, generator=g).to(torch.bfloat16)
    seq_lens, qsl = torch.tensor([200, 100], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    out = paged_attention(q.cuda(), cache, used.int()[tables.long()].cuda(), qsl.cuda(), seq_lens.cuda(),
                          max_query_len=1, max_seq_len=200, scale=spec.scale, v_head_dim=64,
                          kv_shared=True)  # fmt: skip
    shared = AttentionLayerSpec(AttentionKind.FULL, 0, 6, 3, 64, 64, scale=spec.scale, kv_shared=True)
    meta = AttentionMetadata(
        qsl, seq_lens, (seq_lens - 1).long(), torch.zeros(0, dtype=torch.long), tables, 128, 1, 200
    )
    want = TorchAttentionBackend()._forward_decode(shared, q.double(), small.double(), meta)
    err = ((out.double().cpu() - want).norm() / want.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"

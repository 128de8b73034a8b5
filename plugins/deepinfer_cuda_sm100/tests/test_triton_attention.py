"""The Triton paged-attention kernel against the conformance suite's float64 dense reference
(prefill, chunked prefill with a cached prefix, decode, batch invariance), on a real GPU when
there is one and in Triton's interpreter on the CPU otherwise; plus split-KV and bf16 checks
against the core's torch reference backend."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec  # noqa: E402
from deepinfer_core.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from deepinfer_core.platform import TorchPlatform  # noqa: E402
from deepinfer_core.testing.attention import AttentionBackendSuite  # noqa: E402
from deepinfer_core.testing.paged_batch import scattered_batch  # noqa: E402
from deepinfer_cuda_sm100.attention import TritonAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonAttention(AttentionBackendSuite):
    supported_kinds = (AttentionKind.FULL, AttentionKind.MLA, AttentionKind.SLIDING)

    @pytest.fixture
    def platform(self):
        return TorchPlatform(DEVICE, DEVICE)

    @pytest.fixture
    def backend(self, spec, platform):
        return TritonAttention()


def _batch(spec, lens, new, dtype, block_size=16, seed=0):
    """Random cache contents for requests of context ``lens`` (the last ``new`` tokens of each
    are this step's queries), scattered over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    batch = scattered_batch(lens, new, block_size=block_size, generator=g, spare_blocks=2)
    backend = TorchAttentionBackend()
    cache = torch.randn(backend.kv_cache_shape(spec, int(batch.block_tables.max()) + 1, block_size), generator=g).to(
        dtype
    )
    meta = batch.metadata(DEVICE, slot_mapping=torch.zeros(0, dtype=torch.long))  # no K/V write here
    q = torch.randn(batch.num_tokens, spec.num_heads, spec.head_dim, generator=g).to(DEVICE, dtype)
    return q, cache.to(DEVICE), meta


def _reference(spec, q, cache, meta):
    ref = TorchAttentionBackend()
    q64 = q.double()
    return (
        ref._forward_padded(spec, q64, cache.double(), meta)
        if meta.max_query_len > 1
        else ref._forward_decode(spec, q64, cache.double(), meta)
    )


MLA = AttentionLayerSpec(
    AttentionKind.MLA,
    0,
    num_heads=16,
    num_kv_heads=1,
    head_dim=80,
    v_head_dim=64,
    scale=0.1,
    rope_dim=16,
    kv_shared=True,
)
GQA = AttentionLayerSpec(AttentionKind.FULL, 0, num_heads=9, num_kv_heads=3, head_dim=64, v_head_dim=64, scale=0.125)


@pytest.mark.parametrize("spec", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("splits", [1, 3, 16])  # 16: most splits of the short requests are empty
def test_decode_with_split_kv_matches_reference(spec, splits):
    from deepinfer_cuda_sm100.kernels.paged_attention import LaunchConfig, paged_attention

    q, cache, meta = _batch(spec, [1, 40, 130, 77], 1, torch.float32)
    cfg = LaunchConfig(block_m=16, block_n=16, num_splits=splits, num_warps=4, num_stages=2)
    out = paged_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max_query_len=1,
                          max_seq_len=meta.max_seq_len, scale=spec.scale, v_head_dim=spec.v_head_dim,
                          kv_shared=spec.kv_shared, config=cfg)  # fmt: skip
    torch.testing.assert_close(out.double(), _reference(spec, q, cache, meta), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("spec", [GQA, MLA], ids=["gqa", "mla"])
def test_bf16_prefill_over_cached_prefix_is_close_to_reference(spec):
    from deepinfer_cuda_sm100.kernels.paged_attention import LaunchConfig, paged_attention

    q, cache, meta = _batch(spec, [20, 45], 19, torch.bfloat16, seed=3)
    cfg = LaunchConfig(block_m=32, block_n=16, num_splits=1, num_warps=4, num_stages=2)
    out = paged_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                          max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=spec.scale,
                          v_head_dim=spec.v_head_dim, kv_shared=spec.kv_shared, config=cfg)  # fmt: skip
    ref = _reference(spec, q, cache, meta)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits,dv", [(2, 64), (5, 72), (16, 512)])
def test_split_merge_kernel_is_the_softmax_weighted_sum_of_partials(splits, dv, dtype):
    """The merge launch against float64 softmax weights (torch.softmax over the splits' log-sum-
    exps): empty splits (-inf) weigh nothing, a row no split saw is 0, every element is written."""
    from deepinfer_cuda_sm100.kernels.paged_attention import merge_splits

    g = torch.Generator().manual_seed(splits * 1000 + dv)
    T, H = 3, 5
    part = torch.randn(splits, T, H, dv, generator=g)
    lse = torch.randn(splits, T, H, generator=g) * 4
    lse[-1, 1] = float("-inf")  # an empty split in some rows
    lse[:, 2, 3] = float("-inf")  # a row that saw no key at all
    w = torch.softmax(lse.double(), dim=0).nan_to_num(0.0)
    expected = (part.double() * w[..., None]).sum(0)
    out = torch.full((T, H, dv), float("nan"), dtype=dtype, device=DEVICE)
    merge_splits(part.to(DEVICE), lse.to(DEVICE), out)
    assert not out.isnan().any()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double().cpu(), expected, **tol)
    assert (out[2, 3] == 0).all()


@pytest.mark.parametrize("spec", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_write_kernel_equals_the_reference_scatter(spec, dtype):
    """The one-launch K/V write against the core's ``write_kv`` on the same random cache: the
    whole cache equal afterwards (every other slot untouched), K and V planes, slots scattered
    over shuffled blocks; a K/V slice with strided rows (from a fused projection) too."""
    from deepinfer_core.attention.torch_ref import write_kv as reference
    from deepinfer_cuda_sm100.kernels.paged_attention import write_kv

    g = torch.Generator().manual_seed(11)
    backend = TorchAttentionBackend()
    cache = torch.randn(backend.kv_cache_shape(spec, 6, 16), generator=g).to(DEVICE, dtype)
    T = 9
    slots = torch.randperm(6 * 16, generator=g)[:T].to(DEVICE)
    width = spec.num_kv_heads * (spec.head_dim + spec.v_head_dim)
    kv = torch.randn(T, width + 3, generator=g).to(DEVICE, dtype)[:, :width]  # strided rows
    k = kv[:, : spec.num_kv_heads * spec.head_dim].view(T, spec.num_kv_heads, spec.head_dim)
    v = kv[:, spec.num_kv_heads * spec.head_dim :].view(T, spec.num_kv_heads, spec.v_head_dim)
    want = cache.clone()
    reference(spec, k, v, want, slots)
    write_kv(k, None if spec.kv_shared else v, cache, slots, spec.head_dim, spec.v_head_dim)
    assert torch.equal(cache, want)

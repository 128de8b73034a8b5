"""The Triton DeepSeek-V4 attention kernel (sliding, CSA, HCA): against the V4 conformance
suite's float64 loop, and against the core's torch reference backend (``v4_ref``) on the same
cache for decode with split-KV, bf16 prefill over a ring, and the ring it leaves behind. On a
real GPU when there is one, in Triton's interpreter on the CPU otherwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec  # noqa: E402
from deepinfer_core.attention.v4_ref import TorchV4AttentionBackend  # noqa: E402
from deepinfer_core.models.deepseek_v4.kv import V4LayerCache  # noqa: E402
from deepinfer_core.platform import TorchPlatform  # noqa: E402
from deepinfer_core.testing.paged_batch import scattered_batch  # noqa: E402
from deepinfer_core.testing.v4_attention import V4AttentionBackendSuite  # noqa: E402
from deepinfer_cuda_sm100.attention import TritonV4Attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonV4Attention(V4AttentionBackendSuite):
    supported_kinds = (AttentionKind.SLIDING, AttentionKind.COMPRESSED_SPARSE, AttentionKind.HEAVILY_COMPRESSED)

    @pytest.fixture
    def platform(self):
        return TorchPlatform(DEVICE, DEVICE)

    @pytest.fixture
    def backend(self, spec, platform):
        return TritonV4Attention()


KINDS = {
    "sliding": (AttentionKind.SLIDING, 0),
    "csa": (AttentionKind.COMPRESSED_SPARSE, 4),
    "hca": (AttentionKind.HEAVILY_COMPRESSED, 8),
}


def _spec(name: str, heads: int = 5, window: int = 9, topk: int = 6) -> AttentionLayerSpec:
    kind, ratio = KINDS[name]
    return AttentionLayerSpec(kind, 0, num_heads=heads, num_kv_heads=1, head_dim=32, v_head_dim=32, scale=32**-0.5,
                              rope_dim=8, kv_shared=True, window=window, compress_ratio=ratio,
                              index_topk=topk if ratio == 4 else 0, state_kv=True)  # fmt: skip


def _case(spec, lens, new, dtype, seed=0, block_size=32):
    """Requests with ``lens`` tokens of context after this step (the last ``new`` of each are
    the queries), random rings and entries over a shuffled block table and shuffled slots, and
    for CSA a random distinct choice of visible entries per token (some slots -1)."""
    g = torch.Generator().manual_seed(seed)
    R, D = len(lens), spec.head_dim
    batch = scattered_batch(lens, new, block_size=block_size, generator=g, spare_blocks=2)
    ratio = spec.compress_ratio
    per_block = block_size // ratio if ratio else 0
    width = D + (16 if spec.kind is AttentionKind.COMPRESSED_SPARSE else 0)  # CSA rows carry an indexer key
    cache = V4LayerCache(
        entries=torch.randn(int(batch.block_tables.max()) + 1, per_block, width, generator=g).to(DEVICE, dtype),
        window=torch.randn(R + 2, spec.window - 1, D, generator=g).to(DEVICE, dtype),
        tail=torch.zeros(R + 2, 0, 0, device=DEVICE, dtype=dtype),
    )
    positions = batch.positions
    selected = None
    if spec.kind is AttentionKind.COMPRESSED_SPARSE:
        rows = []
        for p in positions.tolist():
            visible = (p + 1) // ratio
            pick = torch.randperm(visible, generator=g)[: spec.index_topk].tolist()
            rows.append(pick + [-1] * (spec.index_topk - len(pick)))
        selected = torch.tensor(rows, dtype=torch.long, device=DEVICE)
    # V4 keys go to the rings and entries, never to slot_mapping
    meta = batch.metadata(
        DEVICE, slot_mapping=torch.zeros_like(positions), state_slots=torch.randperm(R + 2, generator=g)[:R].to(DEVICE)
    )
    q = torch.randn(batch.num_tokens, spec.num_heads, D, generator=g).to(DEVICE, dtype)
    kv = torch.randn(batch.num_tokens, D, generator=g).to(DEVICE, dtype)
    sinks = torch.randn(spec.num_heads, generator=g).to(DEVICE)
    return q, kv, sinks, cache, meta, selected


def _copy(cache: V4LayerCache) -> V4LayerCache:
    return V4LayerCache(cache.entries.clone(), cache.window.clone(), cache.tail.clone())


def _run_both(spec, case, **launch):
    from deepinfer_cuda_sm100.kernels.v4_attention import v4_attention

    q, kv, sinks, cache, meta, selected = case
    ref_cache = _copy(cache)
    ref = TorchV4AttentionBackend().forward_v4(spec, q.double(), kv.double(), sinks,
                                               V4LayerCache(ref_cache.entries.double(), ref_cache.window.double(),
                                                            ref_cache.tail), meta, selected)  # fmt: skip
    ours_cache = _copy(cache)
    out = v4_attention(spec.kind.value, q, kv, sinks, ours_cache.window,
                       ours_cache.entries if spec.compress_ratio else None, selected, meta.block_tables,
                       meta.query_start_loc, meta.seq_lens, meta.state_slots, window=spec.window,
                       ratio=spec.compress_ratio, block_size=meta.block_size, max_query_len=meta.max_query_len,
                       max_seq_len=meta.max_seq_len, scale=spec.scale, **launch)  # fmt: skip
    return out, ref, ours_cache


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_split_kv_matches_reference(name, splits):
    from deepinfer_cuda_sm100.kernels.paged_attention import LaunchConfig

    spec = _spec(name)
    case = _case(spec, [1, 12, 70, 41], 1, torch.float32, seed=splits)
    cfg = LaunchConfig(block_m=16, block_n=16, num_splits=splits, num_warps=4, num_stages=2)
    out, ref, ours_cache = _run_both(spec, case, config=cfg)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    # the ring: each request's slot now holds its new key at pos % rows, other rows untouched
    q, kv, sinks, cache, meta, selected = case
    want = cache.window.clone()
    want[meta.state_slots, meta.positions % want.shape[1]] = kv
    assert torch.equal(ours_cache.window, want)


@pytest.mark.parametrize("name", list(KINDS))
def test_prefill_chunks_longer_than_the_ring_match_reference(name):
    """Chunks of 4..40 new tokens after a cached prefix: window keys straddle ring and chunk, and
    only the last ``rows`` new keys may land in the ring."""
    spec = _spec(name)
    case = _case(spec, [40, 60, 70], 20, torch.float32, seed=8)
    out, ref, ours_cache = _run_both(spec, case)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    q, kv, sinks, cache, meta, selected = case
    want = _copy(cache)
    TorchV4AttentionBackend().forward_v4(spec, q, kv, sinks, want, meta, selected)
    assert torch.equal(ours_cache.window, want.window)


@pytest.mark.parametrize("name", ["csa", "hca"])
def test_bf16_prefill_is_close_to_reference(name):
    spec = _spec(name, heads=4)
    case = _case(spec, [50, 33], 25, torch.bfloat16, seed=3)
    out, ref, _ = _run_both(spec, case)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_head_dim_not_a_power_of_two_takes_the_reference_path():
    spec = AttentionLayerSpec(AttentionKind.SLIDING, 0, num_heads=2, num_kv_heads=1, head_dim=24, v_head_dim=24,
                              scale=0.2, kv_shared=True, window=5, state_kv=True)  # fmt: skip
    q, kv, sinks, cache, meta, selected = _case(spec, [7, 3], 3, torch.float32)
    want_cache = _copy(cache)
    want = TorchV4AttentionBackend().forward_v4(spec, q, kv, sinks, want_cache, meta, None)
    got = TritonV4Attention().forward_v4(spec, q, kv, sinks, cache, meta, None)
    assert torch.equal(got, want) and torch.equal(cache.window, want_cache.window)


def test_csa_without_selection_is_refused_by_name():
    spec = _spec("csa")
    q, kv, sinks, cache, meta, _ = _case(spec, [9], 1, torch.float32)
    with pytest.raises(ValueError, match="selected"):
        TritonV4Attention().forward_v4(spec, q, kv, sinks, cache, meta, None)

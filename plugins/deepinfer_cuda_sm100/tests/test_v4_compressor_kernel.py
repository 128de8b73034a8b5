"""``TritonV4Attention.compress_decode`` (kernels/v4_compressor.py): one compressor's decode step
in one launch leaves the state tails and compressed entries as the core's torch form
(``deepseek_v4_decode.decode_update_entries`` without the kernel) leaves them: CSA (overlapping,
with window 0's missing first half) and HCA compressors, requests that close a window and
requests that do not, a row repeated as graph padding repeats it. Without a GPU the kernel runs
in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.models.deepseek_v4.compress import Compressor  # noqa: E402
from deepinfer_core.models.deepseek_v4.decode import V4DecodeBatch, decode_update_entries  # noqa: E402
from deepinfer_core.models.deepseek_v4.kv import V4LayerCache  # noqa: E402
from deepinfer_core.models.deepseek_v4.layers import V4Rope  # noqa: E402
from deepinfer_cuda_sm100.attention import TritonV4Attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 32


def _setup(overlap: bool, ratio: int, dim: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    comp = Compressor(24, dim, ratio, overlap, 1e-6)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    comp = comp.to(DEVICE)
    comp.proj.to(dtype)
    width = 2 * comp.width
    tail_rows = 2 * ratio if overlap else ratio
    slots, blocks = 6, 16
    cache = V4LayerCache(
        entries=torch.randn(blocks, BLOCK // ratio, dim + 8, generator=g).to(DEVICE, dtype),
        window=torch.zeros(slots, 1, dim, device=DEVICE, dtype=dtype),
        tail=torch.randn(slots, tail_rows, width + 6, generator=g).to(DEVICE, dtype),
    )
    # positions: window 0 closing (no previous window), later windows closing, not closing; row 4 repeats row 0
    positions = torch.tensor([ratio - 1, 3 * ratio - 1, 2 * ratio + 1, 5 * ratio - 1, ratio - 1], device=DEVICE)
    state = torch.tensor([2, 0, 5, 3, 2], device=DEVICE)
    tables = torch.randperm(blocks, generator=g)[:15].view(5, 3).to(DEVICE, torch.int32)
    tables[4] = tables[0]
    batch = V4DecodeBatch(positions=positions, slots=state, block_tables=tables, block_size=BLOCK)
    x = torch.randn(5, 24, generator=g).to(DEVICE, dtype)
    x[4] = x[0]
    rope = V4Rope(dim // 4, {"rope_theta": 10000.0, "rope_type": "default"}, 512, DEVICE)
    return comp, cache, batch, x, rope


@pytest.mark.parametrize(
    "overlap,ratio,dim", [(True, 4, 32), (False, 16, 64), (True, 8, 16)], ids=["csa", "hca", "indexer"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_decode_equals_the_torch_form(overlap, ratio, dim, dtype):
    comp, cache, batch, x, rope = _setup(overlap, ratio, dim, dtype, ratio * 7 + dim)
    raw = [comp.project(x)]
    want = V4LayerCache(cache.entries.clone(), cache.window, cache.tail.clone())
    decode_update_entries([(comp, 4)], raw, want, batch, rope)
    calls = []

    def fused(*args):
        calls.append(1)
        return TritonV4Attention().compress_decode(*args)

    got = V4LayerCache(cache.entries.clone(), cache.window, cache.tail.clone())
    decode_update_entries([(comp, 4)], raw, got, batch, rope, fused)
    assert calls == [1]
    torch.testing.assert_close(got.tail, want.tail, rtol=0, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.entries, want.entries, rtol=tol, atol=tol)
    assert not torch.equal(want.entries, cache.entries)  # windows closed: entries were written

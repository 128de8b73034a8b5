"""Batch-invariant ops (``deepinfer_batch_invariant_ops``): under the mode, matmuls (mm, addmm,
bmm, hence F.linear and einsum) and last-dimension means equal torch's, and a row computed alone
is bitwise the row computed inside a larger batch. GPU when present, else Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_cuda_sm100.kernels.invariant import INVARIANT, BatchInvariantOps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ops(x, w, b, wh):
    lin = F.linear(x, w)  # mm
    lin_b = F.linear(x, w, b)  # addmm
    heads = torch.einsum("thn,hnc->thc", x.view(x.shape[0], 2, -1), wh)  # bmm
    norm = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
    weights = x[:, :6].float().abs()
    normalised = weights / weights.sum(dim=-1, keepdim=True)  # top-k weight normalisation
    return lin, lin_b, heads, norm, normalised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_torch_and_rows_do_not_depend_on_the_batch(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).to(DEVICE, dtype)
    w = torch.randn(80, 96, generator=g).to(DEVICE, dtype)
    b = torch.randn(80, generator=g).to(DEVICE, dtype)
    wh = torch.randn(2, 48, 24, generator=g).to(DEVICE, dtype)
    want = ops(x, w, b, wh)
    calls: list[tuple] = []
    from deepinfer_cuda_sm100.kernels import invariant

    real_bmm = invariant.bmm

    def counting(*a, **k):
        calls.append(tuple(a[0].shape))
        return real_bmm(*a, **k)

    invariant.bmm = counting
    assert not INVARIANT.get()
    with BatchInvariantOps():
        assert INVARIANT.get()
        batched = ops(x, w, b, wh)
        alone = [ops(x[i : i + 1], w, b, wh) for i in (0, 17, 36)]
    invariant.bmm = real_bmm
    assert not INVARIANT.get()
    assert calls, "no matmul reached the batch-invariant kernels"
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    for got, ref in zip(batched, want):
        torch.testing.assert_close(got, ref, **tol)
    for row, single in zip((0, 17, 36), alone):
        for got, one in zip(batched, single):
            assert torch.equal(got[row : row + 1], one), f"row {row} differs alone vs in the batch"

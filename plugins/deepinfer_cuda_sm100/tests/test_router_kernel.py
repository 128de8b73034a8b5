"""The router-logits kernel (kernels/router.py) against the core reference
``TorchMoEDispatcher.router_logits`` (``F.linear`` of the widened rows and the float32 weight),
on the GPU when present, else in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.moe.torch_ref import TorchMoEDispatcher  # noqa: E402
from deepinfer_cuda_sm100.moe import TritonMoEDispatcher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("T,E,D,dtype", [(1, 64, 2048, torch.bfloat16), (3, 7, 300, torch.float16), (16, 5, 1030, torch.bfloat16)])
def test_router_logits_match_the_reference(T, E, D, dtype):
    """Odd expert counts and widths (tails of the expert block and of the 1,024-wide step);
    float32 products of the widened rows: within float32 summation-order error of the
    reference, float64 as the independent check."""
    g = torch.Generator().manual_seed(T * 31 + E)
    x = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    w = (torch.randn(E, D, generator=g) / D**0.5).to(DEVICE)
    got = TritonMoEDispatcher().router_logits(x, w)
    want = TorchMoEDispatcher().router_logits(x, w)
    exact = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (T, E)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got.double() - exact).abs().max().item() < 1e-4


def test_router_logits_keep_torch_for_float32_rows_large_batches_and_invariant_mode():
    """float32 rows, more than ROUTER_ROWS tokens and batch-invariant forwards take the
    reference expression itself (bit-identical)."""
    from deepinfer_cuda_sm100.kernels.invariant import INVARIANT
    from deepinfer_cuda_sm100.kernels.router import ROUTER_ROWS

    g = torch.Generator().manual_seed(9)
    w = torch.randn(8, 256, generator=g).to(DEVICE)
    ours, ref = TritonMoEDispatcher(), TorchMoEDispatcher()
    for x in (torch.randn(2, 256, generator=g).to(DEVICE), torch.randn(ROUTER_ROWS + 1, 256, generator=g).to(DEVICE, torch.bfloat16)):
        assert torch.equal(ours.router_logits(x, w), ref.router_logits(x, w))
    x = torch.randn(2, 256, generator=g).to(DEVICE, torch.bfloat16)
    token = INVARIANT.set(True)
    try:
        assert torch.equal(ours.router_logits(x, w), ref.router_logits(x, w))
    finally:
        INVARIANT.reset(token)

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


@pytest.mark.parametrize(
    "T,E,D,dtype",
    [
        (1, 64, 2048, torch.bfloat16),
        (3, 7, 300, torch.float16),
        (16, 5, 1030, torch.bfloat16),
        (17, 9, 700, torch.float16),
        (64, 64, 2048, torch.bfloat16),
    ],
)
def test_router_logits_match_the_reference(T, E, D, dtype):
    """Odd expert counts and widths (tails of the expert block and of the 1,024-wide step), the
    1-16 and the 17-64 row launches;
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


@pytest.mark.parametrize("T,E,D,block_t", [(128, 64, 192, 128), (300, 7, 200, None), (257, 72, 64, 64)])
def test_prefill_router_gemm_matches_the_reference(T, E, D, block_t):
    """The tiled kernel (the float32 weight split into three bf16 parts on the tensor cores):
    odd token, expert and width tails (partial 64- and 128-token blocks, 7 experts in a 16-wide
    block, 72 over two 64-wide blocks, a partial 64-wide step). Float64 is the independent
    check: the split keeps the weight's 24 bits, so the error stays at float32 summation level
    (one bf16 part alone would be ~1e-3 off)."""
    from deepinfer_cuda_sm100.kernels.router import router_gemm

    g = torch.Generator().manual_seed(T + E + D)
    x = torch.randn(T, D, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(E, D, generator=g) / D**0.5).to(DEVICE)
    got = router_gemm(x, w, block_t)
    want = TorchMoEDispatcher().router_logits(x, w)
    exact = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (T, E)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got.double() - exact).abs().max().item() < 1e-4
    assert (x.double() @ w.bfloat16().double().t() - exact).abs().max().item() > 1e-3  # what one part would miss


def test_prefill_batches_take_the_router_gemm():
    """ROUTER_TILE_ROWS bf16 rows through the dispatcher: the tiled kernel's numbers exactly."""
    from deepinfer_cuda_sm100.kernels.router import ROUTER_TILE_ROWS, router_gemm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(ROUTER_TILE_ROWS, 64, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(8, 64, generator=g) / 8).to(DEVICE)
    got = TritonMoEDispatcher().router_logits(x, w)
    assert torch.equal(got, router_gemm(x, w))
    torch.testing.assert_close(got, TorchMoEDispatcher().router_logits(x, w), rtol=1e-5, atol=1e-5)


def test_router_logits_keep_torch_for_float32_rows_mid_batches_and_invariant_mode():
    """float32 rows, ROUTER_ROWS+1 to ROUTER_TILE_ROWS-1 tokens, float16 prefill rows and
    batch-invariant forwards take the reference expression itself (bit-identical)."""
    from deepinfer_cuda_sm100.kernels.invariant import INVARIANT
    from deepinfer_cuda_sm100.kernels.router import ROUTER_ROWS, ROUTER_TILE_ROWS

    g = torch.Generator().manual_seed(9)
    w = torch.randn(8, 256, generator=g).to(DEVICE)
    ours, ref = TritonMoEDispatcher(), TorchMoEDispatcher()
    mid = (ROUTER_ROWS + 1, ROUTER_TILE_ROWS - 1)
    xs = [
        torch.randn(2, 256, generator=g).to(DEVICE),
        torch.randn(ROUTER_TILE_ROWS, 256, generator=g).to(DEVICE, torch.float16),
    ]
    for x in xs + [torch.randn(t, 256, generator=g).to(DEVICE, torch.bfloat16) for t in mid]:
        assert torch.equal(ours.router_logits(x, w), ref.router_logits(x, w))
    token = INVARIANT.set(True)
    try:
        for t in (2, ROUTER_TILE_ROWS):
            x = torch.randn(t, 256, generator=g).to(DEVICE, torch.bfloat16)
            assert torch.equal(ours.router_logits(x, w), ref.router_logits(x, w))
    finally:
        INVARIANT.reset(token)

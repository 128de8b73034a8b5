"""The decode graphs' argmax kernel equals ``torch.argmax`` (ties to the lowest index, rows of
-inf, widths that are not a multiple of the chunk), on the GPU or in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_cuda_sm100.kernels.argmax import CHUNK, argmax_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,width", [(1, 5000), (3, CHUNK), (4, 3 * CHUNK + 17), (2, 700)])
def test_equals_torch_argmax_with_ties_and_masked_rows(rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=g).mul(4).round().div(4)  # coarse values: many ties
    x[0, width // 2] = x[0].max() + 1  # a clear winner in a later chunk
    x[0, width - 1] = x[0, width // 2]  # tied with the last column: the earlier one wins
    if rows > 1:
        x[1] = float("-inf")  # everything masked: index 0, as torch.argmax
    if rows > 2:
        x[2, : width // 3] = float("-inf")
    x = x.to(DEVICE)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, torch.argmax(x, dim=-1))
    assert got[0].item() == width // 2


def test_bf16_and_strided_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2 * 3000, generator=g).to(DEVICE, torch.bfloat16)[:, ::2]
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))

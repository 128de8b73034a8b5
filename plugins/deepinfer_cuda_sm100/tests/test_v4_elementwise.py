"""``FusedOps.v4_rms_norm``, ``v4_unweighted_rms_norm`` and ``v4_rope`` (kernels/v4_elementwise.py)
equal the core's torch ops (``V4RMSNorm``, ``unweighted_rms_norm``, ``V4Rope.apply``) on query-,
key-, output- and hyper-connection-shaped tensors, float32 and bf16, strided inputs included; wrong
shapes are refused by name. (A tiny V4 with them installed keeps transformers' tokens:
test_hyper_connection_kernel.py.) Without a GPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.models.deepseek_v4.layers import V4RMSNorm, V4Rope, unweighted_rms_norm  # noqa: E402
from deepinfer_cuda_sm100.kernels.v4_elementwise import v4_rms_norm, v4_rope, v4_unweighted_rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 96), (2, 512)])
def test_v4_rms_norm_equals_the_module(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    norm = V4RMSNorm(shape[-1], 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    want = norm(x)
    got = v4_rms_norm(x, norm.weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 96), (2, 4 * 1024)])  # query heads; 4 streams of 1,024 flattened
def test_v4_unweighted_rms_norm_equals_the_reference(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    wide = (torch.randn(*shape[:-1], shape[-1] + 8, generator=g) * 3).to(DEVICE, dtype)
    x = wide[..., 8:]  # strided rows, as a reshaped projection may be
    want = unweighted_rms_norm(x, 1e-6)
    got = v4_unweighted_rms_norm(x, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    elif DEVICE == "cuda":  # the rsqrt rounded to bf16 before the product, as the reference: where the float32
        # sums (summed in another order) round it one bf16 step apart, that row's products differ by up to two steps
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
        assert (got == want).float().mean() > 0.9
    else:  # Triton's interpreter rounds float32 to bf16 towards zero (the GPU to nearest): a step more, each rounding;
        # the reference's two roundings done that way give the interpreted kernel's values
        torch.testing.assert_close(got.float(), want.float(), rtol=2.4e-2, atol=2e-2)

        def towards_zero(t):
            return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)

        xf = x.float()
        rms = towards_zero(torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6))
        assert (got.float() == towards_zero(xf * rms)).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,rope", [((4, 3, 32), 8), ((4, 32), 8), ((2, 16, 512), 64)])
def test_v4_rope_equals_apply(shape, rope, dtype):
    g = torch.Generator().manual_seed(rope + len(shape))
    T = shape[0]
    rotary = V4Rope(rope, {"rope_theta": 10000.0, "rope_type": "default"}, 4096, DEVICE)
    positions = torch.tensor([0, 7, 1000, 4095][:T], device=DEVICE)
    cos, sin = rotary.cos_sin(positions, dtype)
    wide = torch.randn(*shape[:-1], shape[-1] + 8, generator=g).to(DEVICE, dtype)
    x = wide[..., 4 : 4 + shape[-1]]  # strided rows, as slices of a projection are
    for s in (sin, -sin):  # rope and the output's un-rope
        want = V4Rope.apply(x, cos, s)
        got = v4_rope(x, cos, s)
        assert got.dtype == want.dtype and got.shape == want.shape
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert torch.equal(got[..., : shape[-1] - rope], x[..., : shape[-1] - rope])


def test_wrong_shapes_are_refused_by_name():
    x = torch.zeros(2, 3, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"v4_rms_norm: weight must be \[32\]"):
        v4_rms_norm(x, torch.ones(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"v4_rope: cos and sin must be \[T=2, r/2\]"):
        v4_rope(x, torch.ones(3, 4, device=DEVICE), torch.ones(3, 4, device=DEVICE))

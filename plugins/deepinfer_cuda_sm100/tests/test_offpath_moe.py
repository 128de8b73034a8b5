"""The plugin's MoE (the fused routing kernel, then ``moe_align`` and the two grouped GEMMs) on
shapes no other test uses, against the core's reference dispatcher in float64: experts that
receive no token, top-k equal to the number of experts, expert counts and widths that are not
powers of two or multiples of a tile, batches on both sides of each tile-size switch (and, on the GPU,
of the one-program alignment's row limit), and FP8 block-scaled experts whose hidden size is not a
multiple of 128. Small cases run in Triton's interpreter (CI); GPU variants take real sizes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.moe import ExpertWeights, MoESpec  # noqa: E402
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher  # noqa: E402
from deepinfer_cuda_sm100.moe import TritonMoEDispatcher  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(
    not CUDA, reason="the GPU variant needs a CUDA device (the interpreter runs the small cases)"
)


def experts_of(E, D, I, g, fp8=False):
    if not fp8:
        return ExpertWeights(
            (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(DEVICE),
            (torch.randn(E, D, I, generator=g) / I**0.5).to(DEVICE),
        )
    gu, dn = (
        (torch.randn(E, 2 * I, D, generator=g) * 2).to(torch.float8_e4m3fn),
        (torch.randn(E, D, I, generator=g) * 2).to(torch.float8_e4m3fn),
    )
    gus = torch.rand(E, -(-2 * I // 128), -(-D // 128), generator=g) * 0.02 / D**0.5 + 1e-3
    dns = torch.rand(E, -(-D // 128), -(-I // 128), generator=g) * 0.02 / I**0.5 + 1e-3
    return ExpertWeights(gu.to(DEVICE), dn.to(DEVICE), gus.to(DEVICE), dns.to(DEVICE))


def check(spec, T, *, seed=0, dtype=torch.float32, fp8=False, skew=False):
    """Route T random tokens with the plugin and the reference; the same experts must be chosen
    (same weights), and the expert outputs must equal the float64 reference's."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, spec.num_experts, generator=g)
    if skew:  # most experts get no token: a few experts win every token
        logits[:, : max(1, spec.num_experts // 4)] += 3  # (not more: sigmoid would saturate into ties)
    logits = logits.to(DEVICE)
    hidden = torch.randn(T, spec.hidden_size, generator=g).to(DEVICE, dtype)
    experts = experts_of(spec.num_experts, spec.hidden_size, spec.intermediate_size, g, fp8)
    ours, ref = TritonMoEDispatcher(), TorchMoEDispatcher()
    ids, w = ours.select_experts(spec, logits)
    ref_ids, ref_w = ref.select_experts(spec, logits)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    same = (order.values == ref_order.values).all(-1)
    # scores computed by two float32 implementations: a row may flip where two candidates are
    # within an ulp (~1e-5 of the rows at 64 experts, more at 256); none at all below 250 tokens
    assert int((~same).sum()) <= T // 250, (
        f"the plugin chose other experts than the reference in {int((~same).sum())} of {T} rows"
    )
    torch.testing.assert_close(
        w.gather(1, order.indices)[same], ref_w.gather(1, ref_order.indices)[same], atol=1e-6, rtol=1e-5
    )
    got = ours.forward(spec, hidden, ids, w, experts)
    assert got.dtype == dtype and got.shape == hidden.shape
    plain = (
        experts.dequantized(torch.float64) if fp8 else ExpertWeights(experts.gate_up.double(), experts.down.double())
    )
    x = hidden.double()
    if fp8 and dtype != torch.float32:  # 16-bit activations go e4m3 per 128 channels: compare loosely
        want = ref.forward(spec, x, ids, w, plain)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 6e-2, f"relative error {err:.2e}"
    elif dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref.forward(spec, x, ids, w, plain), atol=2e-5, rtol=1e-4)
    else:
        want = ref.forward(spec, x, ids, w, plain)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"relative error {err:.2e}"
    counts = torch.bincount(ids.flatten().cpu(), minlength=spec.num_experts)
    assert torch.equal(ours.expert_load().cpu(), counts)
    return counts


def moe(E, k, D, I, scoring="sigmoid", groups=1, topk_groups=1):
    return MoESpec(0, num_experts=E, top_k=k, hidden_size=D, intermediate_size=I, scoring=scoring, routed_scaling=1.7,
                   num_groups=groups, topk_groups=topk_groups)  # fmt: skip


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    E=st.integers(1, 12), D=st.sampled_from([8, 24, 40, 72]), I=st.sampled_from([8, 24, 40, 72]), T=st.integers(1, 24),
    scoring=st.sampled_from(["sigmoid", "softmax"]), data=st.data(),
)  # fmt: skip
def test_random_shapes_match_the_float64_reference(E, D, I, T, scoring, data):
    k = data.draw(st.integers(1, E))
    check(moe(E, k, D, I, scoring), T, seed=E * 100 + T, skew=data.draw(st.booleans()))


def test_experts_with_no_token():
    counts = check(moe(16, 1, 40, 24), 3, skew=True)
    assert (counts == 0).sum() >= 13


@pytest.mark.parametrize("E", [1, 3, 8])
def test_top_k_equal_to_the_number_of_experts(E):
    check(moe(E, E, 24, 40, "softmax"), 5, seed=E)


@pytest.mark.parametrize("T", [1, 17, 65, 257], ids=lambda t: f"T{t}")
def test_batches_across_tile_switches(T):
    """2 experts, top-2: 2T rows; the tile is 16 rows up to 128 rows, 64 up to 512, then 128."""
    check(moe(2, 2, 24, 16), T, seed=T)


@pytest.mark.parametrize("D", [136, 200])
def test_fp8_experts_with_a_hidden_size_not_a_multiple_of_128(D):
    check(moe(5, 2, D, 128), 7, fp8=True, seed=D)


# -- GPU --------------------------------------------------------------------------------


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 17, 65, 257, 1000, 4099])
def test_gpu_batch_sizes(T, dtype):
    """From 1,000 tokens (6,000 routed rows) the alignment is torch's (ALIGN_MAX_ROWS 2,048)."""
    check(moe(64, 6, 2000, 352, groups=8, topk_groups=3), T, seed=T, dtype=dtype)
    check(moe(7, 7, 300, 72, "softmax"), T, seed=T + 1, dtype=dtype, skew=True)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 17, 300, 3000])
def test_gpu_fp8_experts(T, dtype):
    check(moe(16, 4, 1000, 256), T, seed=T, dtype=dtype, fp8=True)


@gpu_only
@pytest.mark.parametrize("T", [1, 64, 257])
def test_gpu_deepseek_v3_routing_shape(T):
    """DeepSeek-V3's routing: 256 experts in 8 groups, the best 4 groups, top-8 (the one-program
    alignment walks 2,056 rows at 257 tokens: past ALIGN_MAX_ROWS, torch's)."""
    check(moe(256, 8, 1024, 256, groups=8, topk_groups=4), T, seed=T, dtype=torch.bfloat16)

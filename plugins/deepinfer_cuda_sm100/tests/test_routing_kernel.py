"""The one-program routing kernel against the core's reference routing (TorchMoEDispatcher):
the same experts for every token and the same weights (up to the normalising sum's order), for
DeepSeek-V3's biased group-limited sigmoid routing and plain softmax / sigmoid top-k; on the GPU
when present, else in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.moe import MoESpec  # noqa: E402
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher  # noqa: E402
from deepinfer_cuda_sm100.kernels.routing import fused_routing_supported, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {
    "v3-groups-bias": dict(
        num_experts=64, top_k=6, scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling=2.5, bias=True
    ),
    "sigmoid-nogroups": dict(num_experts=24, top_k=3, scoring="sigmoid", normalize_topk=False, bias=False),
    "softmax-groups-max": dict(num_experts=32, top_k=4, scoring="softmax", num_groups=4, topk_groups=2, bias=False),
    "softmax-bias-norm": dict(num_experts=10, top_k=2, scoring="softmax", bias=True),
    "v4-sqrtsoftplus-bias": dict(num_experts=64, top_k=6, scoring="sqrtsoftplus", routed_scaling=1.5, bias=True),
    "sqrtsoftplus-nobias": dict(num_experts=8, top_k=2, scoring="sqrtsoftplus", bias=False),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("T", [1, 37])
def test_routing_kernel_matches_reference(name, T):
    kw = dict(CASES[name])
    bias_on = kw.pop("bias")
    spec = MoESpec(0, hidden_size=8, intermediate_size=8, **kw)
    assert fused_routing_supported(spec, None)
    g = torch.Generator().manual_seed(T + len(name))
    logits = (torch.randn(T, spec.num_experts, generator=g) * 3).to(DEVICE)
    bias = (torch.randn(spec.num_experts, generator=g) * 0.3).to(DEVICE) if bias_on else None
    ref_ids, ref_w = TorchMoEDispatcher().select_experts(spec, logits, bias)
    ids, w = route(spec, logits, bias)
    assert ids.dtype == torch.long and w.dtype == torch.float32
    ref_order, order = ref_ids.sort(dim=1), ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=2e-6, atol=1e-7)
    if not bias_on:  # best first: without a bias the choice score is the weight's own score
        assert (w.diff(dim=1) <= 0).all()


def test_unsupported_routings_are_declined():
    assert not fused_routing_supported(MoESpec(0, 8, 2, 8, 8, scoring="hash"), None)
    assert not fused_routing_supported(MoESpec(0, 12, 2, 8, 8, scoring="sigmoid", num_groups=4, topk_groups=2), None)

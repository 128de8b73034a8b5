"""Programmatic dependent launch (``kernels/pdl``): where it is on, and that a chain of the decode
step's kernels launched with it (each starting before the previous one ends, the GEMVs loading
their first weight slab before the wait) gives bit-identical results to plain launches, eagerly
and replayed from a CUDA graph, where every kernel reads what the one before it just wrote."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_cuda_sm100.kernels import pdl  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_off_on_cpu_tensors_and_by_the_variable(monkeypatch):
    x = torch.zeros(2)
    assert not pdl.enabled(x) and pdl.launch_kw(x) == {"PDL": False}
    if torch.cuda.is_available():
        y = torch.zeros(2, device="cuda")
        monkeypatch.setenv("DEEPINFER_PDL", "0")
        assert pdl.launch_kw(y) == {"PDL": False}
        monkeypatch.delenv("DEEPINFER_PDL")
        # on by default from SM90 on (Hopper): this Triton launches with PDL
        assert pdl.enabled(y) == HOPPER
        assert pdl.launch_kw(y) == ({"PDL": True, "launch_pdl": True} if HOPPER else {"PDL": False})


def _chain(x, r, w_a, g_a, w_uk, w_b, g_n, experts, ids, weights):
    """A decode layer's order of launches at one row: the GEMV with the norm folded in, the
    per-head GEMV (N contiguous), add + norm, the GEMV, SiLU-and-mul, the MoE GEMVs with the row
    sum, the norm, argmax."""
    from deepinfer_cuda_sm100.kernels.argmax import argmax_rows
    from deepinfer_cuda_sm100.kernels.bf16_gemv import dense_linear, head_linear
    from deepinfer_cuda_sm100.kernels.fused_elementwise import add_rms_norm, rms_norm, silu_and_mul
    from deepinfer_cuda_sm100.kernels.fused_moe import _sum_rows
    from deepinfer_cuda_sm100.kernels.moe_gemv import moe_gemv

    a = dense_linear(x, w_a, norm=(g_a, 1e-6))  # [1, 256]
    h = head_linear(a.view(1, 4, 64), w_uk)  # [1, 4, 128]
    n, res = add_rms_norm(h.reshape(1, 512), r, g_n, 1e-6)
    b = silu_and_mul(dense_linear(n, w_b))  # [1, 256]
    rows = moe_gemv(torch.cat([b, b], dim=1), experts[0], experts[1], ids, weights, None, None, None)
    m = _sum_rows(rows, res, ids.shape[1])
    out = rms_norm(m, g_n, 1e-6)
    return out, argmax_rows(out.float())


@pytest.mark.skipif(not HOPPER, reason="PDL needs a GPU of compute capability 9.0 or newer")
def test_a_chain_of_pdl_launches_is_bit_identical_to_plain_launches(monkeypatch):
    g = torch.Generator().manual_seed(7)
    dev, bf = "cuda", torch.bfloat16
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dev, bf)  # noqa: E731
    x, r = rnd(1, 512), rnd(1, 512)
    w_a, g_a = rnd(256, 512, scale=0.05), (torch.rand(512, generator=g) + 0.5).to(dev, bf)
    w_uk = rnd(4, 64, 128, scale=0.1).transpose(1, 2)  # [4, 128, 64], read along N
    w_b, g_n = rnd(512, 512, scale=0.05), (torch.rand(512, generator=g) + 0.5).to(dev, bf)
    experts = (rnd(8, 1024, 512, scale=0.05), rnd(8, 512, 512, scale=0.05))  # gate_up [E, 2I, D], down [E, D, I]
    ids = torch.tensor([[3, 5, 0]], device=dev)
    weights = torch.tensor([[0.5, 0.3, 0.2]], device=dev)
    args = (x, r, w_a, g_a, w_uk, w_b, g_n, experts, ids, weights)

    results = {}
    for on in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_PDL", on)
        eager = _chain(*args)
        _chain(*args)  # compiled and warm before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain(*args)
        replays = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            replays.append(tuple(t.clone() for t in captured))
        results[on] = (eager, replays)
    plain, fast = results["0"][0], results["1"][0]
    assert all(torch.equal(p, f) for p, f in zip(plain, fast))
    for on in ("0", "1"):
        for rep in results[on][1]:
            assert all(torch.equal(p, c) for p, c in zip(plain, rep))

"""FP8 block-scaled weights (DeepSeek's e4m3 + one float32 scale per 128 x 128 tile): the dense
GEMM and the fused MoE's FP8 path against float64 products with the dequantized weights, on the
GPU when present, else in Triton's interpreter. float32 activations multiply the exact weights;
bf16 activations are quantized per row and 128 channels (amax / 448, e4m3), DeepSeek's scheme,
re-stated here in torch for the references."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.moe import ExpertWeights, MoESpec  # noqa: E402
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher  # noqa: E402
from deepinfer_cuda_sm100.kernels.fp8_gemm import fp8_linear  # noqa: E402
from deepinfer_cuda_sm100.kernels.fused_moe import MoEConfig, fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_weight(*shape, g):
    """Random FP8 values and random positive tile scales (not powers of two)."""
    w = (torch.randn(*shape, generator=g) * 2).to(torch.float8_e4m3fn)
    grid = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    return w.to(DEVICE), (torch.rand(grid, generator=g) * 0.02 + 0.001).to(DEVICE)


def dequant64(w, s):
    """float64 weights, tile scales expanded by hand (independent of the core's helper)."""
    full = s.double().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., : w.shape[-2], : w.shape[-1]]
    return w.double() * full


def act_quant64(x):
    """Activations as the kernels quantize them, back in float64: per row and 128 channels,
    scale = amax / 448, values rounded to e4m3."""
    M, K = x.shape
    g = torch.nn.functional.pad(x.double(), (0, -K % 128)).view(M, -1, 128)
    scale = (g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0).float().double()
    return ((g / scale).float().to(torch.float8_e4m3fn).double() * scale).view(M, -1)[:, :K]


@pytest.mark.parametrize(
    "M,N,K,dtype",
    [
        (1, 200, 300, torch.float32),
        (5, 256, 384, torch.bfloat16),
        (70, 130, 256, torch.bfloat16),
        (300, 136, 128, torch.bfloat16),
        (300, 136, 256, torch.float32),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_fp8_linear_matches_dequantized_product(M, N, K, dtype):
    g = torch.Generator().manual_seed(M * 7 + N)
    w, s = fp8_weight(N, K, g=g)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    got = fp8_linear(x, w, s)
    assert got.dtype == dtype and got.shape == (M, N) and torch.isfinite(got).all()
    exact = x.double() @ dequant64(w, s).t()
    want = exact if dtype == torch.float32 else act_quant64(x) @ dequant64(w, s).t()
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 4e-3), f"relative error {err:.2e}"
    assert ((got.double() - exact).norm() / exact.norm()).item() < 6e-2  # e4m3 activations stay close


@pytest.mark.parametrize("M,N,K", [(1, 200, 1024), (5, 256, 640), (16, 130, 2048)])
def test_split_k_summed_in_kernel_equals_the_separate_sum(M, N, K, monkeypatch):
    """Decode-sized GEMMs split along K (the tiled kernel: the GEMV for 1-2 rows switched off):
    with arrival counters the tile's last program sums the splits (one launch) and the result
    is bit-identical to the separate sum launch and close to the float64 product; the counters
    are back at zero after every launch (graph replays reuse them), and a second call gives the
    same bits."""
    from deepinfer_cuda_sm100.kernels import fp8_gemv
    from deepinfer_cuda_sm100.kernels.fp8_gemm import SplitCounters, _splits

    monkeypatch.setattr(fp8_gemv, "GEMV_ROWS", 0)

    assert _splits(M, N, K, 16 if M <= 16 else 64, 64) > 1  # the shapes do split
    g = torch.Generator().manual_seed(M * 11 + K)
    w, s = fp8_weight(N, K, g=g)
    x = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
    counters = SplitCounters()
    fused, again = fp8_linear(x, w, s, counters=counters), fp8_linear(x, w, s, counters=counters)
    separate = fp8_linear(x, w, s)
    assert len(counters._buffers) == 1 and not next(iter(counters._buffers.values())).any()
    assert torch.equal(fused, separate) and torch.equal(fused, again)
    for _ in range(50 if DEVICE == "cuda" else 0):  # a missed arrival or a stale read shows as a moving result
        assert torch.equal(fp8_linear(x, w, s, counters=counters), separate)
    want = act_quant64(x) @ dequant64(w, s).t()
    assert ((fused.double() - want).norm() / want.norm()).item() < 6e-3  # bf16 outputs; 4.3e-3 seen at K = 2048
    wider = torch.randn(17, K, generator=g).to(DEVICE, torch.bfloat16)  # 17+ rows: the separate sum
    unused = SplitCounters()
    assert torch.equal(fp8_linear(wider, w, s, counters=unused), fp8_linear(wider, w, s)) and not unused._buffers


@pytest.mark.parametrize("M,N,K", [(1, 200, 300), (2, 130, 1024), (3, 256, 640), (4, 48, 2176)])
def test_fp8_gemv_matches_dequantized_product(M, N, K):
    """Decode rows (1-4, bf16) go through the GEMV kernel: ragged columns and K (tails of a
    column tile, of a 128-group and of a 512-wide K step), split K summed in-kernel (counters)
    or by the separate launch, both bit-identical and repeatable, close to the float64 product
    of e4m3 activations and the dequantized weight, and close to the tiled GEMM's result."""
    from deepinfer_cuda_sm100.kernels import fp8_gemv as module
    from deepinfer_cuda_sm100.kernels.fp8_gemm import SplitCounters

    g = torch.Generator().manual_seed(M * 13 + K)
    w, s = fp8_weight(N, K, g=g)
    x = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
    cfg = module.GemvConfig(block_n=16, groups=4, warps=4, target_programs=64)
    assert module.gemv_splits(N, K, cfg) == min(-(-K // 512), -(-64 // -(-N // 16)))
    counters = SplitCounters()
    out = lambda: torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)  # noqa: E731
    fused = module.fp8_gemv(x, w, s, out(), counters, cfg)
    separate = module.fp8_gemv(x, w, s, out(), None, cfg)
    assert torch.equal(fused, separate) and torch.equal(module.fp8_gemv(x, w, s, out(), counters, cfg), fused)
    assert all(not b.any() for b in counters._buffers.values())  # counters back at zero
    want = act_quant64(x) @ dequant64(w, s).t()
    assert ((fused.double() - want).norm() / want.norm()).item() < 6e-3
    via_linear = fp8_linear(x, w, s)  # the default tiling: the GEMV too for <= GEMV_ROWS rows
    assert ((via_linear.double() - want).norm() / want.norm()).item() < 6e-3
    tiled = fp8_linear_tiled(x, w, s)
    assert ((fused.double() - tiled.double()).norm() / tiled.double().norm()).item() < 6e-3


def fp8_linear_tiled(x, w, s):
    """``fp8_linear`` with the GEMV switched off (the tiled MMA GEMM for every row count)."""
    from deepinfer_cuda_sm100.kernels import fp8_gemv as module

    saved, module.GEMV_ROWS = module.GEMV_ROWS, 0
    try:
        return fp8_linear(x, w, s)
    finally:
        module.GEMV_ROWS = saved


def test_fp8_gemv_is_bypassed_in_invariant_mode_and_for_float32():
    """Batch-invariant forwards keep the one tiling of every row count (a row alone equals the
    row in a batch); float32 activations keep the exact widened-weight path."""
    from deepinfer_cuda_sm100.kernels.invariant import INVARIANT

    g = torch.Generator().manual_seed(5)
    w, s = fp8_weight(192, 256, g=g)
    x = torch.randn(40, 256, generator=g).to(DEVICE, torch.bfloat16)
    token = INVARIANT.set(True)
    try:
        assert torch.equal(fp8_linear(x[3:4], w, s), fp8_linear(x, w, s)[3:4])
    finally:
        INVARIANT.reset(token)
    x32 = x[:2].float()
    exact = x32.double() @ dequant64(w, s).t()
    assert ((fp8_linear(x32, w, s).double() - exact).norm() / exact.norm()).item() < 1e-6


def test_fp8_linear_rows_do_not_depend_on_the_batch_in_invariant_mode():
    from deepinfer_cuda_sm100.kernels.invariant import INVARIANT

    g = torch.Generator().manual_seed(3)
    w, s = fp8_weight(192, 256, g=g)
    x = torch.randn(40, 256, generator=g).to(DEVICE, torch.bfloat16)
    token = INVARIANT.set(True)
    try:
        assert torch.equal(fp8_linear(x, w, s)[7:8], fp8_linear(x[7:8], w, s))
    finally:
        INVARIANT.reset(token)


def test_fp8_linear_refuses_a_wrong_scale_grid():
    g = torch.Generator().manual_seed(4)
    w, s = fp8_weight(256, 256, g=g)
    with pytest.raises(ValueError, match=r"scale_inv is \(2, 1\), expected \(2, 2\)"):
        fp8_linear(torch.randn(2, 256, device=DEVICE), w, s[:, :1])


def _moe_case(T, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    E, k, D, I = 4, 2, 256, 128
    spec = MoESpec(0, num_experts=E, top_k=k, hidden_size=D, intermediate_size=I, scoring="sigmoid", routed_scaling=2.5)
    gate_up, gs = fp8_weight(E, 2 * I, D, g=g)
    down, ds = fp8_weight(E, D, I, g=g)
    hidden = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    ids, w = TorchMoEDispatcher().select_experts(spec, torch.randn(T, E, generator=g).to(DEVICE))
    return spec, hidden, ids, w, ExpertWeights(gate_up, down, gs, ds)


@pytest.mark.parametrize(
    "T,dtype,prequant",
    [(3, torch.float32, False), (9, torch.bfloat16, False), (9, torch.bfloat16, True), (3, torch.bfloat16, False)],
    ids=["T3-float32", "T9-bfloat16", "T9-bfloat16-prequantized", "T3-bfloat16-gemv"],
)
def test_fused_moe_fp8_matches_dequantized_reference(T, dtype, prequant, monkeypatch):
    """``prequant``: the large-batch path (activations quantized once before each GEMM) forced
    on a small batch; it must compute the same numbers as quantizing inside the K loop."""
    from deepinfer_cuda_sm100.kernels import fused_moe as module

    if prequant:
        monkeypatch.setattr(module, "PREQUANT_ROWS", 0)
    spec, hidden, ids, w, experts = _moe_case(T, dtype, seed=T)
    plain = ExpertWeights(
        dequant64(experts.gate_up, experts.gate_up_scale), dequant64(experts.down, experts.down_scale)
    )
    exact = TorchMoEDispatcher().forward(spec, hidden.double(), ids, w, plain)
    want = exact if dtype == torch.float32 else quantized_moe64(hidden, ids, w, plain, dtype)
    if T * 2 <= 8 and dtype != torch.float32:  # decode rows, no explicit tiling: the per-row GEMVs (moe_gemv)
        got, counts = fused_moe(
            hidden,
            experts.gate_up,
            experts.down,
            ids,
            w,
            gate_up_scale=experts.gate_up_scale,
            down_scale=experts.down_scale,
        )
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 4e-3, f"GEMV: relative error {err:.2e}"
        assert counts.sum().item() == T * 2
    for cfg in (
        MoEConfig(16, 64, 64, 4, 3),
        MoEConfig(64, 128, 128, 4, 2),
        MoEConfig(128, 128, 64, 8, 3),
    ):  # the prefill tile too
        got, counts = fused_moe(
            hidden,
            experts.gate_up,
            experts.down,
            ids,
            w,
            config=cfg,
            gate_up_scale=experts.gate_up_scale,
            down_scale=experts.down_scale,
        )
        err = ((got.double() - want).norm() / want.norm()).item()
        # 16-bit: an expert output near a bf16 rounding boundary rounds apart from the float64
        # model's (both round it, as the reference dispatcher does): ~4e-3 seen, 1.6e-3 unrounded
        assert err < (1e-6 if dtype == torch.float32 else 6e-3), f"{cfg}: relative error {err:.2e}"
        assert counts.sum().item() == T * 2
    # the core reference dispatcher widens FP8 experts itself: same numbers as plain weights
    ref = TorchMoEDispatcher().forward(spec, hidden.float(), ids, w, experts)
    torch.testing.assert_close(ref.double(), exact, rtol=1e-5, atol=1e-5)


def quantized_moe64(hidden, ids, weights, plain, dtype):
    """The fused MoE's arithmetic with e4m3 activations, in float64: per (token, choice) row the
    quantized input times gate / up, each rounded to ``dtype``, SiLU-and-mul rounded, quantized
    again, times down (rounded to ``dtype``), times the routing weight; a token's rows summed."""
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    xq = act_quant64(hidden)
    I = plain.gate_up.shape[1] // 2
    for t in range(hidden.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gu = xq[t : t + 1] @ plain.gate_up[e].t()
            gate, up = gu[:, :I].to(dtype).double(), gu[:, I:].to(dtype).double()
            act = (gate / (1 + torch.exp(-gate)) * up).to(dtype)
            y = (act_quant64(act) @ plain.down[e].t()).to(dtype).double()  # rounded to the activation dtype
            out[t] += y[0] * weights[t, j].double()
    return out


def test_fused_moe_fp8_needs_both_scale_grids():
    spec, hidden, ids, w, experts = _moe_case(2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="both scale grids"):
        fused_moe(hidden, experts.gate_up, experts.down, ids, w, gate_up_scale=experts.gate_up_scale)

"""The shared expert folded into the routed experts' GEMVs (``TritonMoEDispatcher.
forward_with_shared``, kernels/moe_gemv.py) against the float64 reference: routed experts
through the core's reference dispatcher plus the shared expert as a plain SwiGLU MLP, in bf16
and in DeepSeek's FP8 block format; on the GPU when present, else in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.moe import ExpertWeights, MoESpec  # noqa: E402
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher  # noqa: E402
from deepinfer_cuda_sm100.moe import TritonMoEDispatcher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, K, D, I = 4, 2, 256, 128  # small: the interpreter runs a program per (row, 16 columns)


def _weights(g, fp8):
    """Routed experts [E, 2I, D] / [E, D, I] and one shared expert [1, ...]; FP8: e4m3 values
    and random 128 x 128 tile scales; bf16: small random values."""

    def one(n):
        gu = torch.randn(n, 2 * I, D, generator=g) / D**0.5
        dn = torch.randn(n, D, I, generator=g) / I**0.5
        if not fp8:
            return ExpertWeights(gu.to(DEVICE, torch.bfloat16), dn.to(DEVICE, torch.bfloat16))
        return ExpertWeights(
            (gu * 32).to(torch.float8_e4m3fn).to(DEVICE), (dn * 32).to(torch.float8_e4m3fn).to(DEVICE),
            (torch.rand(n, 2 * I // 128, D // 128, generator=g) / 32).to(DEVICE),
            (torch.rand(n, D // 128, I // 128, generator=g) / 32).to(DEVICE),
        )  # fmt: skip

    return one(E), one(1)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_shared_expert_folded_matches_reference(fp8):
    g = torch.Generator().manual_seed(11 + fp8)
    experts, shared = _weights(g, fp8)
    spec = MoESpec(0, num_experts=E, top_k=K, hidden_size=D, intermediate_size=I, scoring="sigmoid", routed_scaling=2.5)
    hidden = torch.randn(1, D, generator=g).to(DEVICE, torch.bfloat16)
    ids, w = TorchMoEDispatcher().select_experts(spec, torch.randn(1, E, generator=g).to(DEVICE))
    ours = TritonMoEDispatcher()
    got = ours.forward_with_shared(spec, hidden, ids, w, experts, shared)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (1, D)
    want = reference(hidden, ids, w, experts.dequantized(torch.float64), shared.dequantized(torch.float64), fp8)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 6e-3, f"relative error {err:.2e}"
    assert torch.equal(ours.expert_load().cpu(), torch.bincount(ids.flatten().cpu(), minlength=E))
    separate = ours.forward(
        spec, hidden, ids, w, experts
    ).double()  # routed alone: the folded sum minus the shared part
    assert ((got.double() - separate).norm() / separate.norm()).item() > 1e-3  # the shared expert is in the sum


def reference(hidden, ids, w, experts, shared, fp8, limit=None, shared_fp8=None):
    """float64: each routed choice (times its weight) and the shared expert (times 1): gate / up
    rounded to bf16, clamped by ``limit`` (gate above, up both sides), SiLU-and-mul rounded;
    FP8: the inputs of both products quantized as the kernels do (e4m3 per row and 128
    channels), for the routed rows (``fp8``) and the shared row (``shared_fp8``, default ``fp8``)."""
    from test_fp8_kernels import act_quant64  # the FP8 kernels' test helper (same directory)

    def quant(on):
        return act_quant64 if on else (lambda t: t.double())

    routed_q, shared_q = quant(fp8), quant(fp8 if shared_fp8 is None else shared_fp8)
    i = experts.down.shape[-1]
    rows = [(experts.gate_up[e], experts.down[e], w[0, j].double(), routed_q) for j, e in enumerate(ids[0].tolist())]
    out = torch.zeros(1, experts.down.shape[1], dtype=torch.float64, device=hidden.device)
    for gu, dn, wt, q in rows + [(shared.gate_up[0], shared.down[0], 1.0, shared_q)]:
        y = q(hidden) @ gu.double().t()
        gate, up = y[:, :i].to(torch.bfloat16).double(), y[:, i:].to(torch.bfloat16).double()
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        act = (gate / (1 + torch.exp(-gate)) * up).to(torch.bfloat16)
        out += (q(act) @ dn.double().t()) * wt
    return out


def test_clamped_shared_expert_folded_matches_reference():
    """DeepSeek-V4's SwiGLU clamp: every row of the fold, the shared expert's too, clamped as
    its ClampedMLP does (a limit the values cross, so the clamp matters)."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(17)
    experts, shared = _weights(g, False)
    experts = ExpertWeights(experts.gate_up * 8, experts.down)  # pre-activations well past the limit
    shared = ExpertWeights(shared.gate_up * 8, shared.down)
    spec = MoESpec(0, num_experts=E, top_k=K, hidden_size=D, intermediate_size=I, scoring="sigmoid", swiglu_limit=1.5)
    hidden = torch.randn(1, D, generator=g).to(DEVICE, torch.bfloat16)
    ids, w = TorchMoEDispatcher().select_experts(spec, torch.randn(1, E, generator=g).to(DEVICE))
    got = TritonMoEDispatcher().forward_with_shared(spec, hidden, ids, w, experts, shared)
    assert got is not None
    f64 = (experts.dequantized(torch.float64), shared.dequantized(torch.float64))
    want = reference(hidden, ids, w, *f64, False, limit=1.5)
    unclamped = reference(hidden, ids, w, *f64, False)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 6e-3, f"relative error {err:.2e}"
    assert ((unclamped - want).norm() / want.norm()).item() > 5e-2  # the clamp changed the result
    wider = replace(spec, swiglu_limit=None)
    assert TritonMoEDispatcher().forward_with_shared(wider, hidden, ids, w, experts, shared) is not None


def test_fp8_shared_expert_beside_mxfp4_experts_folded_matches_reference():
    """DeepSeek-V4's release: routed experts MXFP4, the shared expert FP8 with 128 x 128 scales,
    in the same two GEMV launches (each row decoded in its own format), clamped."""
    from test_mxfp4_moe import packed_experts  # same directory

    from deepinfer_core.quant import quant_fp8_block

    g = torch.Generator().manual_seed(23)
    routed = packed_experts(E, D, I, seed=23)
    gu = torch.randn(2 * I, D, generator=g) / D**0.5
    dn = torch.randn(D, I, generator=g) / I**0.5
    (qg, sg), (qd, sd) = quant_fp8_block(gu), quant_fp8_block(dn)
    shared = ExpertWeights(
        qg[None].to(DEVICE), qd[None].to(DEVICE), sg.float()[None].to(DEVICE), sd.float()[None].to(DEVICE)
    )
    spec = MoESpec(0, num_experts=E, top_k=K, hidden_size=D, intermediate_size=I, scoring="sigmoid", swiglu_limit=2.0)
    hidden = torch.randn(1, D, generator=g).to(DEVICE, torch.bfloat16)
    ids, w = TorchMoEDispatcher().select_experts(spec, torch.randn(1, E, generator=g).to(DEVICE))
    ours = TritonMoEDispatcher()
    got = ours.forward_with_shared(spec, hidden, ids, w, routed, shared)
    assert got is not None and got.shape == (1, D)
    f64 = (routed.dequantized(torch.float64), shared.dequantized(torch.float64))
    want = reference(hidden, ids, w, *f64, False, limit=2.0, shared_fp8=True)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 6e-3, f"relative error {err:.2e}"
    separate = ours.forward(spec, hidden, ids, w, routed).double()
    assert ((got.double() - separate).norm() / separate.norm()).item() > 1e-3  # the shared expert is in the sum
    assert ours.forward_with_shared(spec, hidden.repeat(3, 1), ids.repeat(3, 1), w.repeat(3, 1), routed, shared) is None


@pytest.mark.parametrize("T", [3, 40])
def test_shared_expert_added_in_the_grouped_sum_matches_reference(T):
    """Past the GEMV rows (3 x 3 and 40 x 3 rows), bf16: the shared MLP's output is the last
    addend of each token's float32 sum (grouped GEMMs); float64 reference with the same
    roundings of gate / up and SiLU-and-mul, routed and shared outputs summed unrounded."""
    g = torch.Generator().manual_seed(40 + T)
    experts, shared = _weights(g, False)
    spec = MoESpec(0, num_experts=E, top_k=K, hidden_size=D, intermediate_size=I, scoring="sigmoid", routed_scaling=2.5)
    hidden = torch.randn(T, D, generator=g).to(DEVICE, torch.bfloat16)
    ids, w = TorchMoEDispatcher().select_experts(spec, torch.randn(T, E, generator=g).to(DEVICE))
    ours = TritonMoEDispatcher()
    got = ours.forward_with_shared(spec, hidden, ids, w, experts, shared)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (T, D)
    want = torch.cat(
        [reference(hidden[t : t + 1], ids[t : t + 1], w[t : t + 1], experts, shared, False) for t in range(T)]
    )
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 6e-3, f"relative error {err:.2e}"
    assert torch.equal(ours.expert_load().cpu(), torch.bincount(ids.flatten().cpu(), minlength=E))
    separate = ours.forward(spec, hidden, ids, w, experts).double()
    assert ((got.double() - separate).norm() / separate.norm()).item() > 1e-3  # the shared expert is in the sum


def test_fold_declines_where_it_does_not_apply():
    """float32 rows, batch-invariant forwards, a SwiGLU clamp past the GEMV rows (the grouped
    path's shared MLP has none), a shared expert of another width (one row) or an FP8 one (more
    rows): None (the caller then runs the shared expert itself)."""
    from dataclasses import replace

    from deepinfer_cuda_sm100.kernels.invariant import INVARIANT

    g = torch.Generator().manual_seed(3)
    experts, shared = _weights(g, False)
    spec = MoESpec(0, num_experts=E, top_k=K, hidden_size=D, intermediate_size=I, scoring="sigmoid")
    ids, w = TorchMoEDispatcher().select_experts(spec, torch.randn(3, E, generator=g).to(DEVICE))
    x = torch.randn(3, D, generator=g).to(DEVICE, torch.bfloat16)
    ours = TritonMoEDispatcher()
    fp8_experts, fp8_shared = _weights(g, True)
    assert ours.forward_with_shared(spec, x, ids, w, experts, fp8_shared) is None  # 3 x 3 rows > MOE_GEMV_ROWS
    assert ours.forward_with_shared(spec, x, ids, w, fp8_experts, fp8_shared) is None
    assert ours.forward_with_shared(spec, x[:1].float(), ids[:1], w[:1], experts, shared) is None
    assert ours.forward_with_shared(replace(spec, swiglu_limit=1.0), x, ids, w, experts, shared) is None  # grouped
    narrow = ExpertWeights(shared.gate_up[:, :I, :], shared.down[:, :, : I // 2].contiguous())
    assert ours.forward_with_shared(spec, x[:1], ids[:1], w[:1], experts, narrow) is None
    token = INVARIANT.set(True)
    try:
        assert ours.forward_with_shared(spec, x[:1], ids[:1], w[:1], experts, shared) is None
    finally:
        INVARIANT.reset(token)


@pytest.mark.parametrize("T", [1, 24])
def test_deepseek_v3_moe_layer_folds_its_shared_expert(T):
    """The model wiring: a bf16 DeepseekV3MoE layer on the Triton dispatcher (router kernel,
    routed + shared expert in the per-row GEMVs for one decode token, the shared output added in
    the grouped GEMMs' sum for 24) against the same layer on the core reference dispatcher
    (router, routed experts and the shared MLP separately)."""
    from deepinfer_core.models.deepseek_v3.model import DeepseekV3MoE

    spec = MoESpec(
        0,
        num_experts=E,
        top_k=K,
        hidden_size=D,
        intermediate_size=I,
        scoring="sigmoid",
        routed_scaling=2.5,
        num_shared_experts=1,
    )
    g = torch.Generator().manual_seed(21)
    ours = DeepseekV3MoE({}, spec, TritonMoEDispatcher())
    for p in ours.parameters():
        p.data = (torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).to(p.dtype)
    ours = ours.to(DEVICE, torch.bfloat16)
    ours.gate.float()  # the router stays float32 (restore_float32)
    shared = ours.shared_weights()
    assert (
        shared is not None
        and shared.gate_up.shape == (1, 2 * I, D)
        and shared.gate_up.data_ptr() == ours.shared_experts.gate_up_proj.weight.data_ptr()
    )
    ref = DeepseekV3MoE({}, spec, TorchMoEDispatcher()).to(DEVICE)
    ref.load_state_dict(ours.state_dict())
    ref = ref.to(torch.bfloat16)
    ref.gate.float()
    x = torch.randn(T, D, generator=g).to(DEVICE, torch.bfloat16)
    separate = []
    ours.shared_experts.register_forward_hook(lambda *_: separate.append(1))
    got, want = ours(x), ref(x)
    assert not separate  # folded: the shared MLP module never ran
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    assert ours.dispatcher.expert_load().sum().item() == K * T  # counted once, by the folded path


@pytest.mark.parametrize("hashed", [False, True], ids=["learned", "hash"])
def test_deepseek_v4_moe_layer_folds_its_clamped_shared_expert(hashed):
    """The V4 wiring: a bf16 V4MoE layer (learned or hash routing, clamped SwiGLU) on the Triton
    dispatcher for one decode token, its ClampedMLP shared expert folded into the routed GEMVs,
    against the same layer on the core reference dispatcher (routed experts, then the shared
    MLP module)."""
    from deepinfer_core.models.deepseek_v4.config import parse_config
    from deepinfer_core.models.deepseek_v4.layers import V4MoE, keep_float32, moe_spec
    from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG  # a plain dict: no transformers here

    cfg = parse_config(dict(TINY_V4_CONFIG))
    layer = 0 if hashed else cfg.num_layers - 1
    spec = moe_spec(cfg, layer)
    assert (spec.scoring == "hash") == hashed and spec.swiglu_limit is not None
    g = torch.Generator().manual_seed(31 + hashed)
    ours = V4MoE(cfg, spec, TritonMoEDispatcher())
    for name, p in ours.named_parameters():
        p.data = torch.randn(p.shape, generator=g) * (3.0 if "gate_up" in name else 1.0) / p.shape[-1] ** 0.5
    if hashed:
        ours.gate.tid2eid.copy_(torch.randint(0, spec.num_experts, ours.gate.tid2eid.shape, generator=g))
    ref = V4MoE(cfg, spec, TorchMoEDispatcher())
    ref.load_state_dict(ours.state_dict())
    ours, ref = ours.to(DEVICE, torch.bfloat16), ref.to(DEVICE, torch.bfloat16)
    for m in (ours, ref):
        keep_float32(m)  # as the model does (the correction bias)
        m.bind_shared()
    x = torch.randn(1, cfg.hidden_size, generator=g).to(DEVICE, torch.bfloat16)
    token = torch.randint(0, cfg.vocab_size, (1,), generator=g).to(DEVICE)
    separate = []
    ours.shared_experts.register_forward_hook(lambda *_: separate.append(1))
    got, want = ours(x, token), ref(x, token)
    assert not separate  # folded: the shared MLP module never ran
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2

"""``FusedOps.hc_mix`` (kernels/hyper_connection.py): DeepSeek-V4's hyper-connection weights and
collapse in one launch equal the core's torch reference (``hc_mix_reference``), and a tiny V4
with it, ``hc_merge``, ``v4_rms_norm``, ``v4_unweighted_rms_norm`` and ``v4_rope`` installed
keeps transformers' greedy tokens; ``hc_merge`` equals ``deepseek_v4_layers.hc_merge``.
Without a GPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.models.deepseek_v4.layers import hc_merge as hc_merge_reference  # noqa: E402
from deepinfer_core.models.deepseek_v4.layers import hc_mix_reference
from deepinfer_cuda_sm100 import CudaSM100Platform, plugin  # noqa: E402
from deepinfer_cuda_sm100.kernels.hyper_connection import hc_merge, hc_mix, hc_pre  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "hc,D,T,dtype,iters",
    [(4, 96, 5, torch.float32, 20), (3, 64, 2, torch.bfloat16, 6), (4, 2048, 1, torch.bfloat16, 20)],
)
def test_hc_mix_equals_the_reference(hc, D, T, dtype, iters):
    g = torch.Generator().manual_seed(hc * 100 + D)
    n = (2 + hc) * hc
    mixed = (torch.randn(T, n, generator=g) * 2).to(DEVICE)
    base = torch.randn(n, generator=g).to(DEVICE)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEVICE)
    streams = torch.randn(T, hc, D, generator=g).to(DEVICE, dtype)
    want = hc_mix_reference(mixed, base, scale, streams, iters, 1e-6)
    got = hc_mix(mixed, base, scale, streams, iters, 1e-6)
    for name, a, b in zip(("post", "comb", "collapsed"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        tol = 1e-5 if a.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    assert not torch.allclose(got[1][0], want[1][0].t())  # comb is not symmetric: its layout is checked


@pytest.mark.parametrize(
    "hc,D,T,dtype", [(4, 96, 5, torch.float32), (3, 64, 2, torch.bfloat16), (4, 2048, 1, torch.bfloat16)]
)
def test_hc_merge_equals_the_reference(hc, D, T, dtype):
    g = torch.Generator().manual_seed(hc * 10 + D)
    streams = torch.randn(T, hc, D, generator=g).to(DEVICE, dtype)
    out = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    post = (torch.rand(T, hc, generator=g) * 2).to(DEVICE)
    comb = torch.rand(T, hc, hc, generator=g).to(DEVICE)  # not symmetric: comb^T is checked
    want = hc_merge_reference(streams, out, post, comb)
    got = hc_merge(streams, out, post, comb)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match=r"hc_merge: out must be \[T="):
        hc_merge(streams, out[:, :-1], post, comb)


def test_hc_mix_refuses_a_wrong_shape_by_name():
    streams = torch.zeros(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"hc_mix: mixed must be \[T=2, 24\]"):
        hc_mix(
            torch.zeros(2, 20, device=DEVICE),
            torch.zeros(24, device=DEVICE),
            torch.zeros(3, device=DEVICE),
            streams,
            20,
            1e-6,
        )


def test_the_plugin_offers_it_and_a_tiny_v4_keeps_transformers_tokens(tmp_path):
    pytest.importorskip("transformers")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.fused_ops import FusedOps, install
    from deepinfer_core.models.deepseek_v4.layers import HyperConnection, V4RMSNorm
    from deepinfer_core.models.deepseek_v4.model import V4Attention
    from deepinfer_core.testing.v4_tiny import save_tiny_v4
    from deepinfer_cuda_sm100.kernels.v4_elementwise import v4_rms_norm, v4_rope, v4_unweighted_rms_norm

    ops = plugin.deepinfer_fused_ops(CudaSM100Platform())
    assert (ops.hc_mix, ops.hc_merge, ops.hc_pre, ops.v4_rms_norm, ops.v4_rope, ops.v4_unweighted_rms_norm) == (
        hc_mix,
        hc_merge,
        hc_pre,
        v4_rms_norm,
        v4_rope,
        v4_unweighted_rms_norm,
    )
    model = save_tiny_v4(tmp_path, 99, 5)
    prompt = list(range(3, 13))
    with torch.no_grad():
        want = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=4,
            do_sample=False,
        )
    llm = LLM(str(tmp_path), device=DEVICE, dtype="float32", kv_cache_blocks=8, fused_ops=False, enforce_eager=True)
    fused = sum(isinstance(m, (HyperConnection, V4RMSNorm, V4Attention)) for m in llm.engine.model.modules())
    every = FusedOps(
        hc_mix=hc_mix,
        hc_merge=hc_merge,
        hc_pre=hc_pre,
        v4_rms_norm=v4_rms_norm,
        v4_rope=v4_rope,
        v4_unweighted_rms_norm=v4_unweighted_rms_norm,
    )
    assert install(llm.engine.model, every) == fused > 2 * model.config.num_hidden_layers
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
    assert got == want[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "hc,D,T,dtype",
    [(4, 96, 5, torch.float32), (3, 64, 2, torch.bfloat16), (4, 2048, 1, torch.bfloat16), (4, 200, 3, torch.float32)],
)
def test_hc_pre_equals_the_hyper_connection_forward(hc, D, T, dtype):
    # the input norm and mixing projection as split-K partials summed in hc_mix's kernel: the
    # module's torch forward, float32 rounding apart; K = hc * D not a multiple of the 256-wide slices too
    from deepinfer_core.models.deepseek_v4.config import parse_config
    from deepinfer_core.models.deepseek_v4.layers import HyperConnection
    from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG  # a plain dict: no transformers here

    cfg = parse_config(dict(TINY_V4_CONFIG, hidden_size=D, hc_mult=hc))
    module = HyperConnection(cfg)
    g = torch.Generator().manual_seed(hc * 7 + D)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() == 2 else 1.0))
    module = module.to(DEVICE)
    streams = (torch.randn(T, hc, D, generator=g) * 3).to(DEVICE, dtype)
    want = module(streams)
    got = hc_pre(streams, module.fn, module.base, module.scale, module.iters, module.eps, module.norm_eps)
    for name, a, b in zip(("post", "comb", "collapsed"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        tol = 2e-5 if a.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    # each token alone gives its row of the batch, bit for bit (batch invariance)
    alone = [hc_pre(streams[t : t + 1], module.fn, module.base, module.scale, module.iters, module.eps,
                    module.norm_eps) for t in range(T)]  # fmt: skip
    for i, name in enumerate(("post", "comb", "collapsed")):
        assert torch.equal(torch.cat([a[i] for a in alone]), got[i]), name


def test_hc_pre_declines_prefill_and_batch_invariant_forwards():
    from deepinfer_cuda_sm100.kernels.hyper_connection import HC_PRE_MAX_TOKENS, hc_pre
    from deepinfer_cuda_sm100.kernels.invariant import INVARIANT

    hc, D = 2, 16
    args = (
        torch.zeros(8, hc * D, device=DEVICE),
        torch.zeros(8, device=DEVICE),
        torch.ones(3, device=DEVICE),
        2,
        1e-6,
        1e-6,
    )
    assert hc_pre(torch.zeros(HC_PRE_MAX_TOKENS + 1, hc, D, device=DEVICE), *args) is None
    assert hc_pre(torch.zeros(1, hc, D, device=DEVICE), *args) is not None
    token = INVARIANT.set(True)
    try:
        assert hc_pre(torch.zeros(1, hc, D, device=DEVICE), *args) is None
    finally:
        INVARIANT.reset(token)
    with pytest.raises(ValueError, match=r"hc_pre: fn must be \[8, 32\]"):
        hc_pre(torch.zeros(1, hc, D, device=DEVICE), torch.zeros(8, 30, device=DEVICE), *args[1:])

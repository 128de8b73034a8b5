"""Shapes nobody tuned for, drawn by hypothesis, for the kernels and dispatch rules that the
model-shaped tests pin at a few sizes: the fused routing (group limits, top-k 1-8, biases,
experts not a power of two that the kernel must decline, empty batches), the router GEMV (on
both sides of its row limit), the MoE for 16-bit rows on both sides of the per-row GEMV's
threshold (bf16 and FP8 experts, the shared expert folded in), the FP8 dense GEMM on both
sides of the GEMV / K-split / pre-quantization switches, greedy argmax over odd vocabularies,
and the norms and SiLU-and-mul at widths that are not a power of two.

Every expected value comes from the core's torch reference or a float64 product restated here;
the GPU runs them as they are (prefgpu's series), CI in Triton's interpreter at tiny sizes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.fused_ops import add_rms_norm_reference, rms_norm_reference, silu_and_mul_reference  # noqa: E402
from deepinfer_core.moe import ExpertWeights, MoESpec  # noqa: E402
from deepinfer_core.moe.torch_ref import TorchMoEDispatcher  # noqa: E402
from deepinfer_cuda_sm100.moe import TritonMoEDispatcher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FEW = settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def rel(got, want) -> float:
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


# -- routing -------------------------------------------------------------------------------


@st.composite
def routings(draw):
    """A learned routing a DeepSeek-style config can state: experts a power of two (the kernel)
    or not (the reference), groups dividing the experts, top-k within the kept groups."""
    E = draw(st.sampled_from([1, 3, 6, 16, 32, 64, 96, 256]))
    bias = draw(st.booleans())
    groups = [g for g in (1, 2, 4, 8) if E % g == 0 and (g == 1 or E // g >= 2 or not bias)]
    G = draw(st.sampled_from(groups))
    topk_groups = draw(st.integers(1, G))
    k = draw(st.integers(1, min(8, topk_groups * E // G)))
    scoring = draw(st.sampled_from(["sigmoid", "softmax", "sqrtsoftplus"]))
    spec = MoESpec(0, num_experts=E, top_k=k, hidden_size=8, intermediate_size=8, scoring=scoring, num_groups=G,
                   topk_groups=topk_groups, normalize_topk=draw(st.booleans()),
                   routed_scaling=draw(st.sampled_from([1.0, 2.5])))  # fmt: skip
    return spec, bias, draw(st.integers(0, 20))


@FEW
@given(routings(), st.integers(0, 2**16))
def test_routing_matches_the_reference_for_any_valid_setting(case, seed):
    spec, bias_on, T = case
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, spec.num_experts, generator=g) * 3).to(DEVICE)
    bias = (torch.randn(spec.num_experts, generator=g) * 0.3).to(DEVICE) if bias_on else None
    ids, w = TritonMoEDispatcher().select_experts(spec, logits, bias)
    ref_ids, ref_w = TorchMoEDispatcher().select_experts(spec, logits, bias)
    assert ids.shape == ref_ids.shape == (T, spec.top_k) and w.dtype == torch.float32
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values), f"other experts chosen for {spec}"
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=2e-6, atol=1e-7)


@FEW
@given(
    T=st.integers(1, 18),
    E=st.integers(1, 19),
    D=st.integers(1, 1100),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_router_logits_on_both_sides_of_the_row_limit(T, E, D, dtype):
    g = torch.Generator().manual_seed(T * 1000 + E * 7 + D)
    x = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    w = (torch.randn(E, D, generator=g) / D**0.5).to(DEVICE)
    got = TritonMoEDispatcher().router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (T, E)
    assert (got.double() - x.double() @ w.double().t()).abs().max().item() < 1e-4
    if dtype == torch.bfloat16:  # the prefill GEMM (4,096+ rows in use) at any T, E, D: tails of every tile
        from deepinfer_cuda_sm100.kernels.router import router_gemm

        rows = torch.randn(T * 5, D, generator=g).to(DEVICE, dtype)
        tiled = router_gemm(rows, w)
        assert tiled.shape == (T * 5, E) and (tiled.double() - rows.double() @ w.double().t()).abs().max().item() < 1e-4


# -- MoE experts, 16-bit rows ---------------------------------------------------------------


def experts_of(E, D, I, g, fp8):
    if not fp8:
        gu, dn = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
        return ExpertWeights(gu.to(DEVICE, torch.bfloat16), dn.to(DEVICE, torch.bfloat16))
    gu, dn = (
        (torch.randn(E, 2 * I, D, generator=g) * 2).to(torch.float8_e4m3fn),
        (torch.randn(E, D, I, generator=g) * 2).to(torch.float8_e4m3fn),
    )
    gus = torch.rand(E, -(-2 * I // 128), -(-D // 128), generator=g) * 0.02 / D**0.5 + 1e-3
    dns = torch.rand(E, -(-D // 128), -(-I // 128), generator=g) * 0.02 / I**0.5 + 1e-3
    return ExpertWeights(gu.to(DEVICE), dn.to(DEVICE), gus.to(DEVICE), dns.to(DEVICE))


def swiglu64(x, e: ExpertWeights, i: int, fp8: bool):
    """Expert i of ``e`` (float64 weights) on 16-bit rows x; FP8 experts see what the kernels
    feed them: the rows and the SiLU-and-mul output quantized as DeepSeek's scheme states
    (``act_quant64``), gate and up rounded to bf16 first."""
    q = act_quant64 if fp8 else (lambda a: a)
    gate, up = (q(x) @ e.gate_up[i].t()).chunk(2, dim=-1)
    if fp8:
        gate, up = gate.to(torch.bfloat16).double(), up.to(torch.bfloat16).double()
        return q((torch.nn.functional.silu(gate) * up).to(torch.bfloat16).double()) @ e.down[i].t()
    return (torch.nn.functional.silu(gate) * up) @ e.down[i].t()


@st.composite
def moe_cases(draw):
    fp8 = draw(st.booleans())
    E = draw(st.integers(1, 9))
    k = draw(st.integers(1, min(E, 8)))
    T = draw(st.integers(0, max(1, 16 // k)))  # T * k on both sides of MOE_GEMV_ROWS (8)
    D = draw(st.sampled_from([8, 40, 136, 200]))
    I = 128 if fp8 else draw(st.sampled_from([8, 24, 72]))
    return fp8, E, k, T, D, I, draw(st.booleans())


@FEW
@given(moe_cases(), st.integers(0, 2**16))
def test_bf16_moe_rows_on_both_sides_of_the_gemv_threshold(case, seed):
    """The dispatcher's forward (the per-row GEMVs up to 8 rows, the grouped GEMMs above) and,
    where it applies, forward_with_shared, against float64 products of the same weights (FP8:
    widened exactly, activations quantized as the scheme states). Experts may receive no
    token; T may be 0."""
    fp8, E, k, T, D, I, with_shared = case
    g = torch.Generator().manual_seed(seed)
    spec = MoESpec(0, num_experts=E, top_k=k, hidden_size=D, intermediate_size=I, scoring="softmax")
    experts, shared = experts_of(E, D, I, g, fp8), experts_of(1, D, I, g, fp8)
    hidden = torch.randn(T, D, generator=g).to(DEVICE, torch.bfloat16)
    ids = (
        torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        if T
        else torch.zeros(0, k, dtype=torch.long)
    )
    ids = ids.to(DEVICE)
    w = torch.rand(T, k, generator=g).to(DEVICE)
    wide = lambda e: e.dequantized(torch.float64) if fp8 else ExpertWeights(e.gate_up.double(), e.down.double())  # noqa: E731
    x = hidden.double()
    want = torch.zeros(T, D, dtype=torch.float64, device=DEVICE)
    for t in range(T):
        for c in range(k):
            want[t] += w[t, c].double() * swiglu64(x[t : t + 1], wide(experts), int(ids[t, c]), fp8)[0]
    ours = TritonMoEDispatcher()
    got = (
        ours.forward(spec, hidden, ids, w, experts)
        if not with_shared
        else ours.forward_with_shared(spec, hidden, ids, w, experts, shared)
    )
    if with_shared and got is None:  # declined (no rows, or more than the GEMVs take): the layer runs it apart
        assert T == 0 or T * (k + 1) > 8
        return
    if with_shared:
        want = want + swiglu64(x, wide(shared), 0, fp8)
    assert got.shape == (T, D) and got.dtype == torch.bfloat16
    if T:
        assert rel(got, want) < 1.5e-2, f"relative error {rel(got, want):.2e}"
    counts = torch.bincount(ids.flatten().cpu(), minlength=E)
    assert torch.equal(ours.expert_load().cpu(), counts)


# -- FP8 dense GEMM -------------------------------------------------------------------------


def act_quant64(x):
    """DeepSeek's activation scheme restated: per row and 128 channels, scale = amax / 448, e4m3."""
    M, K = x.shape
    grp = torch.nn.functional.pad(x.double(), (0, -K % 128)).view(M, -1, 128)
    scale = (grp.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0).float().double()
    return ((grp / scale).float().to(torch.float8_e4m3fn).double() * scale).view(M, -1)[:, :K]


@FEW
@given(M=st.sampled_from([1, 2, 3, 16, 17, 64, 65, 127, 128, 130]), N=st.integers(1, 300), K=st.integers(1, 700),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), counters=st.booleans(), lead=st.booleans())  # fmt: skip
def test_fp8_linear_for_any_rows_and_widths(M, N, K, dtype, counters, lead):
    """Rows across GEMV_ROWS (2), FIXUP_ROWS (16), the K-split limit (64) and PREQUANT_ROWS
    (128); N and K any (tails of the 128 x 128 scale tiles); x with a leading batch dimension."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import SplitCounters, fp8_linear

    g = torch.Generator().manual_seed(M * 100003 + N * 701 + K)
    w = (torch.randn(N, K, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // 128), -(-K // 128), generator=g) * 0.02 + 0.001
    full = s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    x = torch.randn(M, K, generator=g).to(dtype)
    xin = x.view(1, M, K) if lead else x
    got = fp8_linear(xin.to(DEVICE), w.to(DEVICE), s.to(DEVICE), SplitCounters() if counters else None)
    assert got.shape == (*xin.shape[:-1], N) and got.dtype == dtype
    a = x.double() if dtype == torch.float32 else act_quant64(x)
    want = a @ (w.double() * full).t()
    assert rel(got.reshape(M, N).cpu(), want) < (1e-5 if dtype == torch.float32 else 6e-3)  # float32: summation order


# -- argmax, norms, SiLU-and-mul ------------------------------------------------------------


@FEW
@given(
    N=st.integers(0, 4),
    V=st.integers(1, 3100),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_argmax_over_any_vocabulary(N, V, dtype, seed):
    from deepinfer_cuda_sm100.kernels.argmax import argmax_rows

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g).mul(2).round().to(DEVICE, dtype)  # coarse: ties across chunks
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


@FEW
@given(
    rows=st.integers(0, 5),
    D=st.integers(1, 1500),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_norms_and_silu_and_mul_at_any_width(rows, D, dtype, seed):
    from deepinfer_cuda_sm100.kernels.fused_elementwise import add_rms_norm, rms_norm, silu_and_mul

    g = torch.Generator().manual_seed(seed)
    x, r = ((torch.randn(rows, D, generator=g) * 3).to(DEVICE, dtype) for _ in range(2))
    w = (torch.rand(D, generator=g) + 0.5).to(DEVICE, dtype)
    pairs = [(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))]
    got, h = add_rms_norm(x, r, w, 1e-6)
    want, want_h = add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(h, want_h)
    pairs += [(got, want), (silu_and_mul(x), silu_and_mul_reference(x))] if D % 2 == 0 else [(got, want)]
    for got, want in pairs:
        assert got.shape == want.shape and got.dtype == want.dtype
        if rows:
            assert rel(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)


# -- DeepSeek-V4 norms and rope ---------------------------------------------------------------


@FEW
@given(
    T=st.integers(0, 4),
    H=st.integers(0, 3),
    D=st.integers(8, 600),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_v4_norms_and_rope_at_any_width(T, H, D, data, dtype):
    """Any rope width the V4 config accepts (even, <= head_dim: e.g. 24 or 48, whose halves are
    not powers of two), any head width, any head count (2D rows for H = 0), empty batches."""
    from deepinfer_core.models.deepseek_v4.layers import V4RMSNorm, V4Rope, unweighted_rms_norm
    from deepinfer_cuda_sm100.kernels.v4_elementwise import v4_rms_norm, v4_rope, v4_unweighted_rms_norm

    rope = 2 * data.draw(st.integers(1, D // 2))
    g = torch.Generator().manual_seed(T * 10007 + D * 31 + rope)
    x = torch.randn(T, *((H,) if H else ()), D, generator=g).to(DEVICE, dtype)
    cos, sin = V4Rope(rope, {"rope_theta": 10000.0, "rope_type": "default"}, 4096, DEVICE).cos_sin(
        torch.randint(0, 4096, (T,), generator=g).to(DEVICE), dtype
    )
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(v4_rope(x, cos, sin), V4Rope.apply(x, cos, sin), rtol=tol, atol=tol)
    norm = V4RMSNorm(D, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
        torch.testing.assert_close(v4_rms_norm(x, norm.weight, 1e-6), norm(x), rtol=tol, atol=tol)
    torch.testing.assert_close(v4_unweighted_rms_norm(x, 1e-6), unweighted_rms_norm(x, 1e-6), rtol=tol, atol=2 * tol)


@FEW
@given(
    hc=st.integers(1, 6),
    D=st.integers(1, 1300),
    T=st.integers(0, 3),
    iters=st.integers(1, 20),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_hyper_connections_at_any_stream_count_and_width(hc, D, T, iters, dtype):
    """hc_mix (the Sinkhorn weights and collapse) and hc_merge for any number of streams (V4
    uses 4), widths past one 512 / 1,024-wide step, empty batches."""
    from deepinfer_core.models.deepseek_v4.layers import hc_merge as hc_merge_reference
    from deepinfer_core.models.deepseek_v4.layers import hc_mix_reference
    from deepinfer_cuda_sm100.kernels.hyper_connection import hc_merge, hc_mix

    g = torch.Generator().manual_seed(hc * 1000 + D + T)
    n = (2 + hc) * hc
    mixed, base, scale = (
        (torch.randn(T, n, generator=g) * 2).to(DEVICE),
        torch.randn(n, generator=g).to(DEVICE),
        (torch.rand(3, generator=g) + 0.5).to(DEVICE),
    )
    streams = torch.randn(T, hc, D, generator=g).to(DEVICE, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(
        hc_mix(mixed, base, scale, streams, iters, 1e-6), hc_mix_reference(mixed, base, scale, streams, iters, 1e-6)
    ):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    out = torch.randn(T, D, generator=g).to(DEVICE, dtype)
    post, comb = (torch.rand(T, hc, generator=g) * 2).to(DEVICE), torch.rand(T, hc, hc, generator=g).to(DEVICE)
    got, want = hc_merge(streams, out, post, comb), hc_merge_reference(streams, out, post, comb)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# -- attention: wide GQA groups, MQA with many heads, wide heads; MLA prefill at any widths ---------


@FEW
@given(kv_heads=st.integers(1, 2), groups=st.sampled_from([7, 12, 16, 24, 40]),
       head_dim=st.sampled_from([20, 64, 136, 256]), decode=st.booleans(), seed=st.integers(0, 2**16))  # fmt: skip
def test_paged_attention_with_wide_groups_and_heads(kv_heads, groups, head_dim, decode, seed):
    """Query heads per KV head past one 16-row tile (Falcon-style MQA, 40 heads a KV head),
    head widths with a tail past a power of two (136) and 256, decode (split-KV) and prefill over
    a cached prefix; the K/V write and the output against the core's reference in float64."""
    from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
    from deepinfer_core.attention.torch_ref import TorchAttentionBackend
    from deepinfer_core.testing.paged_batch import scattered_batch
    from deepinfer_cuda_sm100.attention import TritonAttention

    spec = AttentionLayerSpec(
        AttentionKind.FULL, 0, kv_heads * groups, kv_heads, head_dim, head_dim, scale=head_dim**-0.5
    )
    g = torch.Generator().manual_seed(seed)
    cached = [int(c) for c in torch.randint(0, 40, (2,), generator=g)]
    new = [1, 1] if decode else [int(n) for n in torch.randint(1, 9, (2,), generator=g)]
    batch = scattered_batch([c + n for c, n in zip(cached, new)], new, block_size=16, generator=g, spare_blocks=2)
    ref = TorchAttentionBackend()
    cache = torch.randn(ref.kv_cache_shape(spec, batch.num_blocks, 16), generator=g)
    q, k, v = (torch.randn(batch.num_tokens, h, head_dim, generator=g) for h in (spec.num_heads, kv_heads, kv_heads))
    ours_cache = cache.clone().to(DEVICE)
    got = TritonAttention().forward(spec, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), ours_cache, batch.metadata(DEVICE))
    ref_cache = cache.double().to(DEVICE)
    want = ref.forward(
        spec, q.double().to(DEVICE), k.double().to(DEVICE), v.double().to(DEVICE), ref_cache, batch.metadata(DEVICE)
    )
    assert torch.equal(ours_cache.double(), ref_cache)
    torch.testing.assert_close(got.double(), want, atol=3e-5, rtol=1e-4)


@FEW
@given(heads=st.integers(1, 5), latent=st.sampled_from([16, 24, 40]), rope=st.sampled_from([8, 16, 24]),
       nope=st.sampled_from([8, 16, 40]), v_dim=st.sampled_from([8, 24, 40]), prefix=st.booleans(),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_mla_expanded_prefill_at_any_widths(heads, latent, rope, nope, v_dim, prefix, seed):
    """MLA's non-absorbed prefill (TritonAttention.forward_mla_expanded) for latent, rope, nope
    and value widths that are not powers of two, against the absorbed form in float64 through
    the core's reference attention (multiplying the queries into the latent space instead)."""
    from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
    from deepinfer_core.attention.torch_ref import TorchAttentionBackend
    from deepinfer_core.testing.paged_batch import scattered_batch
    from deepinfer_cuda_sm100.attention import TritonAttention

    spec = AttentionLayerSpec(AttentionKind.MLA, 0, num_heads=heads, num_kv_heads=1, head_dim=latent + rope,
                              v_head_dim=latent, scale=0.2, rope_dim=rope, kv_shared=True)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    new = [int(n) for n in torch.randint(1, 40, (2,), generator=g)]
    lens = [n + (int(torch.randint(1, 30, (1,), generator=g)) if prefix else 0) for n in new]
    batch = scattered_batch(lens, new, block_size=16, generator=g, spare_blocks=2)
    cache = torch.randn(
        TorchAttentionBackend().kv_cache_shape(spec, int(batch.block_tables.max()) + 1, 16), generator=g
    ).to(DEVICE)
    meta = batch.metadata(DEVICE, num_context_tokens=sum(lens), num_attention_pairs=batch.num_attention_pairs)
    key = cache.view(-1, cache.shape[-1])[batch.slot_mapping.to(DEVICE)][
        :, None, : latent + rope
    ]  # the new entries, already in place
    q = torch.randn(batch.num_tokens, heads, nope + rope, generator=g).to(DEVICE)
    w_kv = (torch.randn(heads, nope + v_dim, latent, generator=g) / latent**0.5).to(DEVICE)
    got = TritonAttention(mla_expand_min_tokens=1).forward_mla_expanded(spec, q, key, w_kv, cache, meta)
    qd, wd = q.double(), w_kv.double()
    query = torch.cat([torch.einsum("thn,hnc->thc", qd[..., :nope], wd[:, :nope]), qd[..., nope:]], dim=-1)
    want = torch.einsum(
        "thc,hvc->thv", TorchAttentionBackend()._forward_padded(spec, query, cache.double(), meta), wd[:, nope:]
    )
    assert got.shape == (batch.num_tokens, heads, v_dim)
    torch.testing.assert_close(got.double(), want, atol=3e-5, rtol=1e-4)


# -- DeepSeek-V4 attention ----------------------------------------------------------------------


@FEW
@given(kind=st.sampled_from(["sliding", "csa", "hca"]), heads=st.integers(1, 20), window=st.integers(1, 40),
       ratio=st.sampled_from([4, 8, 32]), topk=st.integers(1, 8), decode=st.booleans(),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_v4_attention_at_any_head_count_window_and_ratio(kind, heads, window, ratio, topk, decode, seed):
    """TritonV4Attention.forward_v4 (the kernel and its ring write) for head counts that are not
    powers of two, windows from 1 (a one-row ring, as the engine sizes it) up, HCA ratios 4-32 (the block's entry count
    down to 1), CSA top-k 1-8 with unused (-1) slots; decode and prefill chunks over a prefix,
    against the core's V4 reference backend in float64 on the same cache."""
    from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
    from deepinfer_core.attention.v4_ref import TorchV4AttentionBackend
    from deepinfer_core.models.deepseek_v4.kv import V4LayerCache
    from deepinfer_core.testing.paged_batch import scattered_batch
    from deepinfer_cuda_sm100.attention import TritonV4Attention

    k_ = {
        "sliding": AttentionKind.SLIDING,
        "csa": AttentionKind.COMPRESSED_SPARSE,
        "hca": AttentionKind.HEAVILY_COMPRESSED,
    }[kind]
    ratio = {"sliding": 0, "csa": 4, "hca": ratio}[kind]
    D, bs = 32, 32
    spec = AttentionLayerSpec(k_, 0, num_heads=heads, num_kv_heads=1, head_dim=D, v_head_dim=D, scale=D**-0.5,
                              rope_dim=8, kv_shared=True, window=window, compress_ratio=ratio,
                              index_topk=topk if kind == "csa" else 0, state_kv=True)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    new = [1, 1, 1] if decode else [int(n) for n in torch.randint(1, 30, (3,), generator=g)]
    lens = [n + int(c) for n, c in zip(new, torch.randint(0, 80, (3,), generator=g))]
    batch = scattered_batch(lens, new, block_size=bs, generator=g, spare_blocks=2)
    width = D + (16 if kind == "csa" else 0)
    cache = V4LayerCache(
        torch.randn(int(batch.block_tables.max()) + 1, bs // ratio if ratio else 0, width, generator=g).to(DEVICE),
        torch.randn(5, max(1, window - 1), D, generator=g).to(DEVICE),
        torch.zeros(5, 0, 0, device=DEVICE),
    )  # fmt: skip (rows as V4LayerCache sizes them)
    selected = None
    if kind == "csa":
        rows = [torch.randperm((p + 1) // ratio, generator=g)[:topk].tolist() for p in batch.positions.tolist()]
        selected = torch.tensor([r + [-1] * (topk - len(r)) for r in rows], dtype=torch.long, device=DEVICE)
    meta = batch.metadata(
        DEVICE,
        slot_mapping=torch.zeros_like(batch.positions),
        state_slots=torch.randperm(5, generator=g)[:3].to(DEVICE),
    )
    q = torch.randn(batch.num_tokens, heads, D, generator=g).to(DEVICE)
    kv = torch.randn(batch.num_tokens, D, generator=g).to(DEVICE)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    ref_cache = V4LayerCache(cache.entries.double(), cache.window.double(), cache.tail)
    want = TorchV4AttentionBackend().forward_v4(spec, q.double(), kv.double(), sinks, ref_cache, meta, selected)
    got = TritonV4Attention().forward_v4(spec, q, kv, sinks, cache, meta, selected)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    assert torch.equal(cache.window.double(), ref_cache.window), "the ring differs from the reference's"


@FEW
@given(
    overlap=st.booleans(),
    ratio=st.sampled_from([2, 4, 8, 16, 32]),
    dim=st.sampled_from([16, 32, 64]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_v4_compressor_decode_at_any_ratio_and_rope_width(overlap, ratio, dim, data, seed):
    """One compressor's decode step in one launch (TritonV4Attention.compress_decode) for
    compression ratios 2-32 (a block of 32 holding 16 entries down to 1), overlapping or not,
    and any even rope width up to the compressed width (halves that are not powers of two),
    against the core's torch form; requests closing their window and not."""
    from deepinfer_core.models.deepseek_v4.compress import Compressor
    from deepinfer_core.models.deepseek_v4.decode import V4DecodeBatch, decode_update_entries
    from deepinfer_core.models.deepseek_v4.kv import V4LayerCache
    from deepinfer_core.models.deepseek_v4.layers import V4Rope
    from deepinfer_cuda_sm100.attention import TritonV4Attention

    rope_dim = 2 * data.draw(st.integers(1, dim // 2))
    g = torch.Generator().manual_seed(seed)
    comp = Compressor(24, dim, ratio, overlap, 1e-6)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    comp = comp.to(DEVICE)
    block = 32
    nb = -(-5 * ratio // block)  # blocks a request's positions reach
    cache = V4LayerCache(torch.randn(4 * nb + 2, block // ratio, dim + 8, generator=g).to(DEVICE),
                         torch.zeros(6, 1, dim, device=DEVICE),
                         torch.randn(6, 2 * ratio if overlap else ratio, 2 * comp.width + 6,
                                     generator=g).to(DEVICE))  # fmt: skip
    positions = torch.tensor([ratio - 1, 3 * ratio - 1, 2 * ratio + 1, 5 * ratio - 1], device=DEVICE)
    batch = V4DecodeBatch(
        positions=positions, slots=torch.tensor([2, 0, 5, 3], device=DEVICE),
        block_tables=torch.randperm(4 * nb + 2, generator=g)[: 4 * nb].view(4, nb).to(DEVICE, torch.int32),
        block_size=block,
    )  # fmt: skip
    raw = [comp.project(torch.randn(4, 24, generator=g).to(DEVICE))]
    rope = V4Rope(rope_dim, {"rope_theta": 10000.0, "rope_type": "default"}, 512, DEVICE)
    want = V4LayerCache(cache.entries.clone(), cache.window, cache.tail.clone())
    decode_update_entries([(comp, 4)], raw, want, batch, rope)
    got = V4LayerCache(cache.entries.clone(), cache.window, cache.tail.clone())
    calls = []
    decode_update_entries(
        [(comp, 4)], raw, got, batch, rope, lambda *a: calls.append(1) or TritonV4Attention().compress_decode(*a)
    )
    assert calls == [1]
    torch.testing.assert_close(got.tail, want.tail, rtol=0, atol=0)
    torch.testing.assert_close(got.entries, want.entries, rtol=1e-5, atol=1e-5)


@FEW
@given(
    heads=st.integers(1, 20),
    di=st.sampled_from([16, 32]),
    topk=st.integers(1, 9),
    decode=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_v4_indexer_scores_at_any_head_count(heads, di, topk, decode, seed):
    """The CSA indexer's masked scores (TritonV4Attention.index_scores) for indexer head counts
    that are not powers of two, widths 16 / 32, any top-k, decode and prefill over a prefix,
    against a float64 loop over each token's visible entries."""

    from deepinfer_core.models.deepseek_v4.batch import V4Batch
    from deepinfer_core.models.deepseek_v4.compress import Indexer
    from deepinfer_core.models.deepseek_v4.config import parse_config
    from deepinfer_core.models.deepseek_v4.kv import V4LayerCache
    from deepinfer_core.models.deepseek_v4.layers import V4Rope
    from deepinfer_core.testing.paged_batch import scattered_batch
    from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG
    from deepinfer_cuda_sm100.attention import TritonV4Attention

    ratio, block, D = 4, 32, 64
    g = torch.Generator().manual_seed(seed)
    cfg = parse_config(dict(TINY_V4_CONFIG) | {"index_n_heads": heads, "index_head_dim": di, "index_topk": topk})
    indexer = Indexer(cfg, ratio)
    for p in indexer.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    indexer = indexer.to(DEVICE).requires_grad_(False)
    news = [1, 1, 1] if decode else [int(n) for n in torch.randint(1, 30, (3,), generator=g)]
    ends = [n + int(c) for n, c in zip(news, torch.randint(0, 50, (3,), generator=g))]
    # the indexer scores only where some request has more than topk compressed entries (prefill.topk_plan)
    assume(max(ends) // ratio > topk)
    paged = scattered_batch(ends, news, block_size=block, generator=g, spare_blocks=2)
    entries = torch.randn(int(paged.block_tables.max()) + 1, block // ratio, D + di, generator=g).to(DEVICE)
    cache = V4LayerCache(entries=entries, window=entries.new_zeros(1, 1, D), tail=entries.new_zeros(1, 0, 0))
    bounds = paged.query_start_loc.tolist()
    batch = V4Batch(tuple(zip(bounds[:-1], bounds[1:])), tuple(e - n for e, n in zip(ends, news)), (0, 1, 2),
                    paged.block_tables.to(DEVICE), block, prompt_lens=tuple(ends))  # fmt: skip
    positions = paged.positions.to(DEVICE)
    meta = paged.metadata(DEVICE, slot_mapping=torch.zeros_like(positions), state_slots=torch.arange(3, device=DEVICE))
    seen = {}

    def scorer(*args):
        seen["args"], seen["out"] = args, TritonV4Attention().index_scores(*args, meta=meta)
        return seen["out"]

    x = torch.randn(paged.num_tokens, cfg.hidden_size, generator=g).to(DEVICE)
    q_res = torch.randn(paged.num_tokens, cfg.q_lora_rank, generator=g).to(DEVICE)
    indexer.select(
        x,
        q_res,
        positions,
        cache,
        batch,
        V4Rope(cfg.rope_dim, cfg.compress_rope, cfg.max_position_embeddings, DEVICE),
        D,
        scorer,
    )
    q, weights, ents, key_col, pos, _b, r, n_max, scale = seen["args"]
    want = torch.full((q.shape[0], n_max), float("-inf"), dtype=torch.float64)
    for req, (a, b) in enumerate(batch.token_ranges):
        for t in range(a, b):
            for w in range((int(pos[t]) + 1) // r):
                key = ents[
                    int(batch.block_tables[req, w // (block // r)]), w % (block // r), key_col : key_col + di
                ].double()
                want[t, w] = float((weights[t].double() * (q[t].double() @ key).clamp_min(0)).sum()) * scale
    torch.testing.assert_close(seen["out"].double().cpu(), want, atol=1e-5, rtol=1e-5)


@FEW
@given(
    B=st.integers(1, 2),
    M=st.integers(1, 70),
    N=st.integers(1, 70),
    K=st.integers(1, 100),
    D=st.integers(1, 600),
    seed=st.integers(0, 2**16),
)
def test_batch_invariant_matmul_and_row_sums_at_any_shape(B, M, N, K, D, seed):
    """The batch-invariant bmm (tails of its 64 x 64 x 32 tiles, a bias) and last-dimension
    sum / mean (tails of the 256-wide step) in float32 against float64, and (on a GPU) a row
    computed alone bitwise equal to the same row inside the batch: the interpreter's ``tl.dot``
    is numpy's BLAS product, whose last bit may depend on the row's place in the tile (seen at
    7 x 3 @ 3 x 1), which the compiled kernel's fixed-order products do not."""
    from deepinfer_cuda_sm100.kernels.invariant import bmm, row_reduce

    g = torch.Generator().manual_seed(seed)
    a, b, bias = (torch.randn(*s, generator=g).to(DEVICE) for s in ((B, M, K), (B, K, N), (N,)))
    got = bmm(a, b, bias, beta=0.5, alpha=2.0)
    torch.testing.assert_close(got.double(), 0.5 * bias.double() + 2.0 * a.double() @ b.double(), atol=1e-4, rtol=1e-4)
    if DEVICE == "cuda":
        assert torch.equal(bmm(a[:, -1:], b, bias, beta=0.5, alpha=2.0), got[:, -1:])
    x = torch.randn(M, D, generator=g).to(DEVICE)
    torch.testing.assert_close(
        row_reduce(x, True, True).double(), x.double().mean(-1, keepdim=True), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(row_reduce(x, False, False).double(), x.double().sum(-1), atol=1e-4, rtol=1e-5)
    assert torch.equal(row_reduce(x[-1:], False, False), row_reduce(x, False, False)[-1:])

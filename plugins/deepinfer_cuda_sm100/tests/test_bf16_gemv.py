"""The 16-bit decode GEMV (``kernels/bf16_gemv``): dense rows and MLA's per-head products against
float64 products of the same 16-bit operands, on the GPU when present, else in Triton's
interpreter; split K summed in-kernel equals the separate sum; torch keeps batch-invariant
forwards, float32 and larger batches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_cuda_sm100.kernels import bf16_gemv as module  # noqa: E402
from deepinfer_cuda_sm100.kernels.fp8_gemm import SplitCounters  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize(
    "M,N,K,dtype",
    [(1, 200, 300, torch.bfloat16), (2, 130, 1024, torch.bfloat16), (1, 48, 2176, torch.float16)],
    ids=str,
)
def test_dense_gemv_matches_the_float64_product(M, N, K, dtype, monkeypatch):
    """Ragged columns and K (tails of a column tile and of a K step), K split and summed in-kernel
    (counters) or by the separate launch: bit-identical and repeatable, within one 16-bit
    rounding of the float64 product; ``dense_linear`` takes the GEMV for these rows."""
    g = torch.Generator().manual_seed(M * 13 + K)
    w = torch.randn(N, K, generator=g).to(DEVICE, dtype)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    cfg = module.Bf16GemvConfig(block_n=16, block_k=256, warps=4, target_programs=64)
    assert module.gemv_splits(N, K, cfg) == min(-(-K // 256), -(-64 // -(-N // 16))) > 1
    counters = SplitCounters()
    out = lambda: torch.full((1, M, N), float("nan"), dtype=dtype, device=DEVICE)  # noqa: E731
    fused = module.gemv(x[None], w[None], out(), counters, cfg)
    separate = module.gemv(x[None], w[None], out(), None, cfg)
    assert torch.equal(fused, separate) and torch.equal(module.gemv(x[None], w[None], out(), counters, cfg), fused)
    assert all(not b.any() for b in counters._buffers.values())  # counters back at zero
    want = x.double() @ w.double().t()
    assert rel(fused[0], want) < 4e-3
    monkeypatch.setattr(module, "GEMV_ROWS", 2)
    got = module.dense_linear(x, w, counters, cfg)
    assert got.shape == (M, N) and got.dtype == dtype and torch.equal(got, fused[0])


@pytest.mark.parametrize("N,K", [(24, 1536), (40, 200)], ids=str)
def test_dense_gemv_with_the_norm_folded_in(N, K):
    """``norm=(g, eps)``: the row RMS-normalised inside the launch (the default config: no K
    split) equals the float64 product of the core's reference norm to a 16-bit rounding; more rows
    take the norm kernel and F.linear."""
    from deepinfer_core.fused_ops import rms_norm_reference

    g = torch.Generator().manual_seed(K)
    w = torch.randn(N, K, generator=g).to(DEVICE, torch.bfloat16)
    gain = (torch.rand(K, generator=g) + 0.5).to(DEVICE, torch.bfloat16)
    x = (torch.randn(3, K, generator=g) * 3).to(DEVICE, torch.bfloat16)
    for rows in (x[:1], x):
        got = module.dense_linear(rows, w, norm=(gain, 1e-6))
        want = rms_norm_reference(rows, gain, 1e-6).double() @ w.double().t()
        assert got.shape == (rows.shape[0], N) and rel(got, want) < 4e-3
    plain = module.dense_linear(x[:1], w)
    assert rel(plain, x[:1].double() @ w.double().t()) < 4e-3


@pytest.mark.parametrize("T", [1, 2])
def test_head_linear_matches_mla_einsums(T):
    """MLA's absorbed products on views of one ``kv_b_proj`` weight ``[H, n + v, C]``: the query
    side reads ``W_UK`` along its contiguous latent axis (``W_UK^T``), the output side ``W_UV``
    along K; both from strided activations (q_nope is a view of q)."""
    H, n, v, C, r = 3, 32, 16, 80, 8
    g = torch.Generator().manual_seed(T)
    w_kv = torch.randn(H * (n + v), C, generator=g).to(DEVICE, torch.bfloat16).view(H, n + v, C)
    w_uk, w_uv = w_kv[:, :n], w_kv[:, n:]
    q = torch.randn(T, H, n + r, generator=g).to(DEVICE, torch.bfloat16)
    q_nope = q[..., :n]
    q_lat = module.head_linear(q_nope, w_uk.transpose(1, 2))
    assert q_lat.shape == (T, H, C)
    assert rel(q_lat, torch.einsum("thn,hnc->thc", q_nope.double(), w_uk.double())) < 4e-3
    lat = torch.randn(T, H, C, generator=g).to(DEVICE, torch.bfloat16)
    out = module.head_linear(lat, w_uv)
    assert out.shape == (T, H, v)
    assert rel(out, torch.einsum("thc,hvc->thv", lat.double(), w_uv.double())) < 4e-3


def test_torch_keeps_float32_larger_batches_and_invariant_mode(monkeypatch):
    """The GEMV is never launched for float32, for more than GEMV_ROWS rows or in batch-invariant
    mode: torch's products come back bit for bit."""
    from deepinfer_cuda_sm100.kernels.invariant import INVARIANT

    def boom(*a, **k):
        raise AssertionError("GEMV launched")

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).to(DEVICE, torch.bfloat16)
    monkeypatch.setattr(module, "gemv", boom)
    x32 = torch.randn(1, 64, generator=g).to(DEVICE)
    assert torch.equal(module.dense_linear(x32, w.float()), torch.nn.functional.linear(x32, w.float()))
    x3 = torch.randn(3, 64, generator=g).to(DEVICE, torch.bfloat16)
    assert torch.equal(module.dense_linear(x3, w), torch.nn.functional.linear(x3, w))
    heads = torch.randn(3, 2, 64, generator=g).to(DEVICE, torch.bfloat16)
    wh = torch.randn(2, 8, 64, generator=g).to(DEVICE, torch.bfloat16)
    assert torch.equal(module.head_linear(heads, wh), torch.einsum("thk,hnk->thn", heads, wh))
    token = INVARIANT.set(True)
    try:
        assert torch.equal(module.dense_linear(x3[:1], w), torch.nn.functional.linear(x3[:1], w))
        assert torch.equal(module.head_linear(heads[:1], wh), torch.einsum("thk,hnk->thn", heads[:1], wh))
    finally:
        INVARIANT.reset(token)
    with pytest.raises(ValueError, match="dense_linear: x has 63 features, weight expects 64"):
        module.dense_linear(x3[:, :63], w)


def test_a_bf16_deepseek_v3_with_the_gemvs_installed_stays_as_close_to_transformers(tmp_path, monkeypatch):
    """A tiny DeepSeek-V3 in bf16 scoring a 2-token prompt (2 rows: the GEMV's range) with
    ``dense_linear`` / ``head_linear`` installed: q_a and kv_a become views of one weight, every
    MLA projection, both absorbed products and the dense / shared MLPs go through the GEMV, and the
    logits stay as close to transformers' float32 ones as the same engine's torch products do."""
    pytest.importorskip("transformers")
    from deepinfer_core import LLM
    from deepinfer_core.fused_ops import FusedOps, install
    from deepinfer_core.testing.v3_checkpoint import TINY_V3_CONFIG, tiny_deepseek_v3

    hf = tiny_deepseek_v3(tmp_path, seed=5, **TINY_V3_CONFIG)
    prompt = [5, 81]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].double()
    llm = LLM(str(tmp_path), device=DEVICE, dtype="bfloat16", kv_cache_blocks=8, max_num_seqs=2, enforce_eager=True,
              fused_ops=False, attention_backend="builtin", moe_backend="builtin")  # fmt: skip
    model = llm.engine.model
    torch_err = rel(llm.engine.prompt_logits(prompt).cpu(), want)
    monkeypatch.setattr(module, "GEMV_ROWS", 2)
    monkeypatch.setattr(module, "PROGRAMS", 4)  # 16 weight rows a program: the interpreter's cost is per program
    launches = []
    real = module.gemv
    monkeypatch.setattr(module, "gemv", lambda x, w, *a, **k: launches.append(tuple(w.shape)) or real(x, w, *a, **k))
    assert (
        install(model, FusedOps(dense_linear=module.dense_linear, head_linear=module.head_linear)) == 2 + 2
    )  # 2 MLA, dense + shared MLP
    attn = model.model.layers[0].self_attn
    both = attn.qkv_a_weight
    assert both.shape == (32 + 32 + 16, 64) and attn.q_a_proj.weight.data_ptr() == both.data_ptr()
    assert attn.kv_a_proj_with_mqa.weight.data_ptr() == both[32:].data_ptr()
    got_err = rel(llm.engine.prompt_logits(prompt).cpu(), want)
    # per MLA layer: q_a + kv_a, q_b, W_UK, W_UV, o; the dense MLP and the shared expert's: 2 each
    assert sorted(launches) == sorted([(1, 80, 64), (1, 64, 32), (2, 32, 16), (2, 16, 32), (1, 64, 32)] * 2
                                      + [(1, 192, 64), (1, 64, 96), (1, 64, 64), (1, 64, 32)])  # fmt: skip
    assert got_err < 1.25 * torch_err + 2e-3, (got_err, torch_err)

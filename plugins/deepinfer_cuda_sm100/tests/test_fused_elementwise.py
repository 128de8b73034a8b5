"""The fused RMSNorm and SiLU-and-mul kernels against the core's references
(deepinfer_core.fused_ops), on the GPU when present, else in Triton's interpreter on the CPU.
bf16 results must equal the reference exactly where rounding points are the same (they are
placed identically); float32 within rounding of a different summation order."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.fused_ops import (
    FusedOps,
    add_rms_norm_reference,
    install,
    norm_rope_cat_reference,
    rms_norm_reference,
    rope_cat_reference,
    silu_and_mul_reference,
)  # noqa: E402
from deepinfer_core.platform import TorchPlatform  # noqa: E402
from deepinfer_cuda_sm100 import CudaSM100Platform, plugin  # noqa: E402
from deepinfer_cuda_sm100.kernels.fused_elementwise import (
    add_rms_norm,
    norm_rope_cat,
    rms_norm,
    rope_cat,
    rotary,
    silu_and_mul,
)  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape and torch.isfinite(got).all()
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err
    if dtype != torch.float32:  # one rounding differs at most on a few exact ties
        assert (got != want).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 512), (3, 1000), (2, 3, 96)])
def test_rms_norm_matches_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE, dtype)
    _close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 512), (3, 1000), (2, 3, 96)])
def test_add_rms_norm_matches_the_reference(dtype, shape):
    """The residual sum is torch's ``residual + x`` bit for bit (it feeds the next layer), the
    norm of it as rms_norm_reference computes it; a float32 weight keeps a float32 output."""
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    r = (torch.randn(*shape, generator=g) * 5).to(DEVICE, dtype)
    for w in (
        (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE, dtype),
        (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE),
    ):
        got, h = add_rms_norm(x, r, w, 1e-6)
        want, want_h = add_rms_norm_reference(x, r, w, 1e-6)
        assert h.dtype == dtype and torch.equal(h, want_h)
        _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_torch_rotation_on_a_strided_qkv_slice(dtype):
    """Llama's q and k rotated together straight from the fused QKV output (rows strided), with
    the cos/sin rows RotaryAt looks up: the same bits as the torch ops (each product and the
    sum rounded to the dtype), for odd head counts and positions far apart."""
    from deepinfer_core.models.layers import Rotary, rope_inv_freq

    g = torch.Generator().manual_seed(5)
    T, H, d = 7, 5, 64
    inv_freq, scale = rope_inv_freq(d, 10000.0, {})
    table = Rotary(d, 4096, inv_freq, scale).to(DEVICE)
    at = table.at(torch.tensor([0, 1, 2, 300, 301, 4000, 17], device=DEVICE), dtype)
    qkv = (torch.randn(T, (H + 2) * d, generator=g) * 3).to(DEVICE, dtype)
    x = qkv[:, : H * d].reshape(T, H, d)
    assert x.stride(0) == (H + 2) * d  # a strided view, not a copy
    got = rotary(x, at.cos, at.sin)
    want = at(x)  # the torch path (no fused op on this table)
    _close(got, want, dtype)
    assert (got != want).float().mean().item() < 1e-3


def test_rms_norm_reads_a_strided_slice_and_keeps_float32_weights_semantics():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 200, generator=g).to(DEVICE, torch.bfloat16)
    x = base[:, :130]  # rows 200 apart, like MLA's latent slice of kv_a
    w = torch.rand(130, generator=g).to(DEVICE) + 0.5  # float32 weight: float32 output
    _close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 64), (7, 300), (3, 1100)])
def test_silu_and_mul_matches_the_reference(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows * inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 2).to(DEVICE, dtype)
    _close(silu_and_mul(x), silu_and_mul_reference(x), dtype)


def test_a_row_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(33, 256, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.rand(256, generator=g).to(DEVICE, torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-6)[7], rms_norm(x[7:8], w, 1e-6)[0])


def test_hook_answers_for_cuda_platforms_and_installs_on_norms_and_mlps():
    from deepinfer_core.models.layers import GatedMLP, RMSNorm

    assert plugin.deepinfer_fused_ops(TorchPlatform("cpu", "cpu")) is None
    ops = plugin.deepinfer_fused_ops(CudaSM100Platform())
    assert (
        isinstance(ops, FusedOps)
        and ops.rms_norm is rms_norm
        and ops.silu_and_mul is silu_and_mul
        and ops.rope_cat is rope_cat
    )
    model = torch.nn.Sequential(RMSNorm(64), GatedMLP(64, 96), RMSNorm(64)).to(DEVICE)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, 64, device=DEVICE)
    want = model(x)
    assert install(model, ops) == 3
    _close(model(x), want, torch.float32)


def test_an_engine_with_the_fused_kernels_installed_keeps_transformers_greedy_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_cuda_sm100.kernels.fused_elementwise import FUSED_OPS

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device=DEVICE, dtype="float32", kv_cache_blocks=8, max_num_seqs=4, enforce_eager=True)
    assert (
        install(llm.engine.model, FUSED_OPS) == 2 * 3 + 1 + 1
    )  # 2 norms and an MLP per layer, the final norm, the rotary table
    prompts = [[5, 6, 7, 8], [9, 10, 11] * 5]
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ]
    hf = hf.to(DEVICE)
    for p, tokens in zip(prompts, got):
        ids = torch.tensor([p], device=DEVICE)
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )
        assert tokens == ref[0, len(p) :].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(
    "H,C,tiled", [(3, 40, False), (3, 40, True), (20, 300, True)], ids=["3heads", "3heads-tiled", "20heads-2tiles"]
)
def test_rope_cat_matches_the_reference_for_queries_and_keys(dtype, interleaved, H, C, tiled, monkeypatch):
    """A program per (token, head) (decode-sized steps), or heads in tiles of up to 16 per program
    (prefill-sized: 20 heads give a full tile and a partial one, and a 300-channel latent is
    copied in chunks of 256)."""
    from deepinfer_cuda_sm100.kernels import fused_elementwise

    monkeypatch.setattr(fused_elementwise, "ROPE_CAT_TILE_TOKENS", 0 if tiled else 1 << 30)
    g = torch.Generator().manual_seed(3)
    T, n, r, P = 9, 8, 16, 300
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    freqs = torch.outer(torch.arange(P).float(), inv)
    cos, sin = (
        (torch.cat([freqs, freqs], -1).cos() * 1.2).to(DEVICE),
        (torch.cat([freqs, freqs], -1).sin() * 1.2).to(DEVICE),
    )
    positions = torch.randint(0, P, (T,), generator=g).to(DEVICE)
    q = torch.randn(T, H, n + r, generator=g).to(DEVICE, dtype)
    q_pe = q.split([n, r], dim=-1)[1]  # a strided view, as MLA splits it
    latent = torch.randn(T, H, C, generator=g).to(DEVICE, dtype)
    got = rope_cat(latent, q_pe, positions, cos, sin, interleaved)
    want = rope_cat_reference(latent, q_pe, positions, cos, sin, interleaved)
    assert got.shape == want.shape and torch.equal(got[..., :C], want[..., :C])
    _close(got, want, dtype)
    kv_a = torch.randn(T, C + r, generator=g).to(DEVICE, dtype)  # the key: one latent row, one rope head
    k_lat, k_pe = kv_a[:, :C][:, None, :], kv_a[:, C:].view(T, 1, r)
    _close(
        rope_cat(k_lat, k_pe, positions, cos, sin, interleaved),
        rope_cat_reference(k_lat, k_pe, positions, cos, sin, interleaved),
        dtype,
    )
    cos, sin = cos.to(dtype), sin.to(dtype)  # a bf16 model's tables are bf16 buffers (found on the H200)
    _close(
        rope_cat(latent, q_pe, positions, cos, sin, interleaved),
        rope_cat_reference(latent, q_pe, positions, cos, sin, interleaved),
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("C", [40, 512])
def test_norm_rope_cat_is_the_norm_then_rope_cat_bit_for_bit(dtype, interleaved, C):
    """MLA's key in one launch (kv_a's norm inside the key's rope_cat): the same bits as the two
    kernels it replaces, on a strided kv_a as the fused q_a + kv_a GEMV leaves it, and close to
    the core's references."""
    g = torch.Generator().manual_seed(C + interleaved)
    T, r, P = 7, 16, 300
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    freqs = torch.outer(torch.arange(P).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos().to(DEVICE), torch.cat([freqs, freqs], -1).sin().to(DEVICE)
    positions = torch.randint(0, P, (T,), generator=g).to(DEVICE)
    qkv_a = (torch.randn(T, 24 + C + r, generator=g) * 3).to(DEVICE, dtype)
    kv_a = qkv_a[:, 24:]
    latent, k_pe = kv_a[:, :C], kv_a[:, C:].view(T, 1, r)
    w = (torch.rand(C, generator=g) + 0.5).to(DEVICE, dtype)
    for c, s in ((cos, sin), (cos.to(dtype), sin.to(dtype))):
        got = norm_rope_cat(latent, w, 1e-6, k_pe, positions, c, s, interleaved)
        two = rope_cat(rms_norm(latent, w, 1e-6)[:, None, :], k_pe, positions, c, s, interleaved)
        assert got.shape == (T, 1, C + r) and torch.equal(got, two)
        _close(got, norm_rope_cat_reference(latent, w, 1e-6, k_pe, positions, c, s, interleaved), dtype)


def test_a_deepseek_v3_engine_with_the_fused_kernels_keeps_transformers_logits_and_tokens(tmp_path):
    pytest.importorskip("transformers")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.testing.v3_checkpoint import TINY_V3_CONFIG, tiny_deepseek_v3

    hf = tiny_deepseek_v3(tmp_path, seed=5, **TINY_V3_CONFIG)
    llm = LLM(str(tmp_path), device=DEVICE, dtype="float32", kv_cache_blocks=8, max_num_seqs=2, enforce_eager=True)
    from deepinfer_cuda_sm100.kernels.fused_elementwise import FUSED_OPS

    assert install(llm.engine.model, FUSED_OPS) >= 2 * 2 + 1 + 2  # norms, the dense and shared MLPs, both MLA layers
    mla = [m for m in llm.engine.model.modules() if type(m).__name__ == "MLAAttention"]
    assert len(mla) == 2 and all(
        m.norm_rope_cat is FUSED_OPS.norm_rope_cat for m in mla
    )  # the key's norm inside its rope_cat
    prompt = [5, 9, 33, 7, 81, 2, 64, 17, 3, 99, 12]
    hf = hf.to(DEVICE)
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad():
        want = hf(ids).logits[0].float()
    got = llm.engine.prompt_logits(prompt).to(want.device)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    tokens = (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    )
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert tokens == ref[0, len(prompt) :].tolist()

"""MLA prefill in the non-absorbed form (``TritonAttention.forward_mla_expanded`` and its Triton
kernel) against the core's absorbed reference, and a tiny DeepSeek-V3 whose prefill steps run
expanded against transformers' (CPU) or the builtin path's (GPU) float32 greedy tokens.

The absorbed reference is an independent computation of the same attention: it multiplies the
queries into the latent space (``W_UK^T q_nope``) and the latent output by ``W_UV``, where the
expanded form decompresses every context token's keys and values through ``kv_b_proj``. Without
a GPU the kernels run in Triton's interpreter on the CPU (tiny shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec  # noqa: E402
from deepinfer_core.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from deepinfer_core.testing.paged_batch import scattered_batch  # noqa: E402
from deepinfer_cuda_sm100.attention import TritonAttention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _spec(heads, latent, rope):
    return AttentionLayerSpec(AttentionKind.MLA, 0, num_heads=heads, num_kv_heads=1, head_dim=latent + rope,
                              v_head_dim=latent, scale=0.15, rope_dim=rope, kv_shared=True)  # fmt: skip


def _batch(spec, lens, new, nope, v_dim, dtype, block_size=16, seed=0):
    """A cache of random latent entries for requests of context ``lens`` (the last ``new[r]`` of
    each are this step's tokens), blocks shuffled; queries and ``kv_b_proj``'s weight."""
    g = torch.Generator().manual_seed(seed)
    H, C, r = spec.num_heads, spec.v_head_dim, spec.rope_dim
    batch = scattered_batch(lens, new, block_size=block_size, generator=g, spare_blocks=2)
    cache = torch.randn(
        TorchAttentionBackend().kv_cache_shape(spec, int(batch.block_tables.max()) + 1, block_size), generator=g
    )
    meta = batch.metadata(DEVICE, num_context_tokens=sum(lens), num_attention_pairs=batch.num_attention_pairs)
    slots = batch.slot_mapping
    key = cache.view(-1, cache.shape[-1])[slots][:, None, : C + r]  # the new tokens' entries, already in place
    q = torch.randn(batch.num_tokens, H, nope + r, generator=g)
    w_kv = torch.randn(H, nope + v_dim, C, generator=g) / C**0.5
    return q.to(DEVICE, dtype), key.to(DEVICE, dtype), w_kv.to(DEVICE, dtype), cache.to(DEVICE, dtype), meta


def _absorbed_reference(spec, q, w_kv, cache, meta, nope):
    """float64, through the core's torch backend in the absorbed form."""
    q, w_kv = q.double(), w_kv.double()
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    query = torch.cat([torch.einsum("thn,hnc->thc", q[..., :nope], w_uk), q[..., nope:]], dim=-1)
    latent = TorchAttentionBackend()._forward_padded(spec, query, cache.double(), meta)
    return torch.einsum("thc,hvc->thv", latent, w_uv)


# whole prompts (no cached prefix: the new entries used as given) and chunks over a cached prefix
# (entries gathered from the cache); 70 and 130 tokens span several 32-row tiles in the interpreter
CASES = {"prefill": ([1, 37, 70], [1, 37, 70]), "prefix": ([40, 130, 77], [5, 50, 77])}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("v_dim", [16, 24])  # 24: a value width that is not a power of two
def test_expanded_attention_equals_the_absorbed_reference(case, v_dim):
    lens, new = CASES[case]
    spec, nope = _spec(heads=3, latent=32, rope=16), 16
    q, key, w_kv, cache, meta = _batch(spec, lens, new, nope, v_dim, torch.float32, seed=v_dim)
    backend = TritonAttention(mla_expand_min_tokens=1)
    assert backend.expand_mla(spec, meta)
    before = cache.clone()
    out = backend.forward_mla_expanded(spec, q, key, w_kv, cache, meta)
    assert torch.equal(cache, before)  # the new entries were written where they already were
    assert out.shape == (q.shape[0], 3, v_dim) and out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), _absorbed_reference(spec, q, w_kv, cache, meta, nope), atol=3e-5, rtol=1e-4
    )


def test_expanded_attention_writes_the_latent_entries_as_the_absorbed_path_does():
    spec, nope = _spec(heads=2, latent=32, rope=16), 16
    q, key, w_kv, cache, meta = _batch(spec, [20, 45], [20, 19], nope, 16, torch.float32, seed=5)
    key = torch.randn(key.shape, generator=torch.Generator().manual_seed(9)).to(
        DEVICE
    )  # new entries not yet in the cache
    want = cache.clone()
    TorchAttentionBackend().forward(
        spec, torch.zeros(q.shape[0], 2, spec.head_dim, device=DEVICE), key, None, want, meta
    )
    out = TritonAttention(mla_expand_min_tokens=1).forward_mla_expanded(spec, q, key, w_kv, cache, meta)
    assert torch.equal(cache, want)
    torch.testing.assert_close(
        out.double(), _absorbed_reference(spec, q, w_kv, cache, meta, nope), atol=3e-5, rtol=1e-4
    )


def test_bf16_expanded_attention_is_close_to_the_reference():
    spec, nope = _spec(heads=2, latent=64, rope=16), 32
    q, key, w_kv, cache, meta = _batch(spec, [20, 90], [20, 60], nope, 32, torch.bfloat16, seed=3)
    out = TritonAttention(mla_expand_min_tokens=1).forward_mla_expanded(spec, q, key, w_kv, cache, meta)
    ref = _absorbed_reference(spec, q, w_kv, cache, meta, nope)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_expanded_form_is_chosen_for_prefill_like_steps_only():
    spec = _spec(heads=2, latent=32, rope=16)
    _q, _key, _w, _cache, meta = _batch(spec, [200, 150], [200, 150], 16, 16, torch.float32)
    pairs = meta.num_attention_pairs
    assert pairs == 200 * 201 // 2 + 150 * 151 // 2
    backend = TritonAttention()
    assert backend.expand_mla(spec, meta)  # 350 new tokens, no prefix
    # the same 350 tokens after a 30,000-token prefix each: 10.5M more pairs for 30,000 more keys
    assert backend.expand_mla(
        spec, dataclasses.replace(meta, num_context_tokens=30350, num_attention_pairs=pairs + 350 * 30000)
    )
    # ... next to 64 decode rows over 2,000 tokens each: 128,000 more keys, one pair each
    assert not backend.expand_mla(
        spec, dataclasses.replace(meta, num_context_tokens=350 + 128000, num_attention_pairs=pairs + 128000)
    )
    # a 2M-token context at 2 heads: 4M decompressed (token, head) rows would be allowed, one more not
    long = dataclasses.replace(meta, num_context_tokens=2 * 2**20, num_attention_pairs=2**40)
    assert backend.expand_mla(spec, long)
    assert not backend.expand_mla(spec, dataclasses.replace(long, num_context_tokens=2 * 2**20 + 1))
    assert not backend.expand_mla(spec, dataclasses.replace(meta, num_context_tokens=0))  # unknown (graph capture)
    assert not backend.expand_mla(spec, dataclasses.replace(meta, num_attention_pairs=0))
    assert not backend.expand_mla(spec, dataclasses.replace(meta, batch_invariant=True))
    assert not backend.expand_mla(spec, dataclasses.replace(meta, max_query_len=1))  # decode
    assert not TritonAttention(mla_expand_min_tokens=400).expand_mla(spec, meta)
    assert not backend.expand_mla(dataclasses.replace(spec, kind=AttentionKind.FULL), meta)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["prefill", "prefix"])
def test_v3_shapes_bf16_on_the_gpu_are_close_to_the_reference(case):
    """DeepSeek-V3's widths (16 heads, latent 512, rope 64, nope 128, v 128) in bf16 with the
    GPU's 128-row tiles, block size 128 as the engine uses."""
    lens, new = (
        ([512, 300, 1000, 129], [512, 300, 1000, 129]) if case == "prefill" else ([700, 1500, 64], [300, 128, 64])
    )
    spec, nope = _spec(heads=16, latent=512, rope=64), 128
    q, key, w_kv, cache, meta = _batch(spec, lens, new, nope, 128, torch.bfloat16, block_size=128, seed=1)
    out = TritonAttention().forward_mla_expanded(spec, q, key, w_kv, cache, meta)
    ref = _absorbed_reference(spec, q, w_kv, cache, meta, nope)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e}"


LOWER = r"""
from deepinfer_cuda_sm100.kernels.lowering import lower
from deepinfer_cuda_sm100.kernels.mla_prefill import _mla_prefill_kernel as fn

types = {n: "*bf16" for n in ("q_ptr", "kn_ptr", "kr_ptr", "v_ptr", "out_ptr")}
types.update(qsl_ptr="*i32", ksl_ptr="*i32", seqlen_ptr="*i32", scale_log2="fp32")
consts = dict(DN=128, DR=64, DV=128, BDN=128, BDR=64, BDV=128, BLOCK_M=128, BLOCK_N=128, IEEE=False, UPCAST=False)
for arch in (90, 100):
    lower(fn, types, consts, arch, 8, 2)
    print("sm%d" % arch)
"""


def test_kernel_compiles_for_sm90_and_sm100_at_v3_widths():
    """bf16, the GPU's 128 x 128 tiles, q/k 128 + 64 and v 128 wide: Triton's ahead-of-time compile for an
    explicit target needs no GPU (the interpreter accepts code the compiler rejects)."""
    from deepinfer_cuda_sm100.kernels import lowering

    if not lowering.supported():
        pytest.skip(lowering.UNSUPPORTED)
    out = lowering.run_script(LOWER, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["sm90", "sm100"]

"""Low-bit GGUF weights on CPU (deepinfer_core.lowbit).

References are independent of the code under test: the ``gguf`` library's own dequantizers and
quantizers for the block formats, a float matmul with those dequantized weights for the kernels,
the dense float32 engine on the same file for greedy outputs, and /proc/cpuinfo for the CPU
feature detection.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from deepinfer_core.builtin.cpu_features import cpu_features  # noqa: E402
from deepinfer_core.lowbit import native, ops  # noqa: E402
from deepinfer_core.lowbit.formats import from_gguf  # noqa: E402

KERNELS = native.load()
needs_kernels = pytest.mark.skipif(KERNELS.lib is None, reason=f"low-bit kernels unavailable here: {KERNELS.reason}")


def _random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw bytes of a [n, k] tensor of ``type_name``: random quants, sane f16 scales."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scales = np.frombuffer(np.full(2, 0.01, np.float16).tobytes(), np.uint8)  # two f16 values
    if type_name in ("Q4_K", "Q5_K"):  # d, dmin first
        raw[..., 0:4] = scales
    elif type_name == "Q6_K":  # d last
        raw[..., -2:] = scales[:2]
    else:  # d first
        raw[..., 0:2] = scales[:2]
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_quantized_tensors_pack_exactly(type_name):
    w = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    packed = from_gguf(type_name, raw, (48, 256))
    assert packed.kind == ("q8" if type_name == "Q8_0" else "q4")
    assert np.array_equal(packed.dequantize().numpy(), expected)


def test_q4_k_super_blocks_pack_exactly():
    raw = _random_blocks("Q4_K", 8, 512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    packed = from_gguf("Q4_K", raw, (8, 512))
    assert packed.kind == "q4" and np.array_equal(packed.dequantize().numpy(), expected)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_K", "Q5_0"])
def test_other_types_are_requantized_to_8_bits_within_half_a_step(type_name):
    raw = _random_blocks(type_name, 8, 512, seed=2)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(8, 512)
    packed = from_gguf(type_name, raw, (8, 512))
    step = np.abs(expected).reshape(8, 16, 32).max(-1, keepdims=True) / 127  # per 32-block
    err = np.abs(packed.dequantize().numpy().reshape(8, 16, 32) - expected.reshape(8, 16, 32))
    assert packed.kind == "q8" and (err <= step / 2 + 1e-6).all()


def test_width_not_a_multiple_of_32_is_refused_by_name():
    with pytest.raises(ValueError, match="K=40 is not a multiple of 32"):
        from_gguf("Q8_0", np.zeros((2, 34), np.uint8), (2, 40))


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("M", [1, 5, 33])
def test_kernel_equals_a_float_matmul_with_the_dequantized_weights(type_name, M):
    w = np.random.default_rng(3).standard_normal((96, 320)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy())
    x = torch.randn(M, 320, generator=torch.Generator().manual_seed(M))
    x[:, 7] *= 20  # an outlier channel: activations are not rounded, so it costs nothing
    got = ops.matmul(x, from_gguf(type_name, raw, (96, 320)))
    assert got.shape == (M, 96)
    torch.testing.assert_close(got, (x.double() @ dense.double().T).float(), rtol=1e-5, atol=1e-4)


@needs_kernels
def test_each_row_s_result_does_not_depend_on_the_batch():
    w = np.random.default_rng(4).standard_normal((64, 256)).astype(np.float32)
    packed = from_gguf("Q4_1", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), (64, 256))
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(0))
    together = ops.matmul(x, packed)
    for i in (0, 7, 18):
        assert torch.equal(ops.matmul(x[i : i + 1], packed)[0], together[i])


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux's /proc/cpuinfo")
def test_cpu_feature_detection_agrees_with_the_kernel_s_flags():
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    features = cpu_features()
    assert features.avx512_bf16 == ("avx512_bf16" in flags)
    assert features.amx == ("amx_tile" in flags)
    assert features.auto_dtype == (torch.bfloat16 if {"avx512_bf16", "amx_tile"} & flags else torch.float32)
    assert ("avx2" in flags) == native.cpu_supports_kernels()[0]


@needs_kernels
@pytest.mark.parametrize("window", [None, 7])
def test_paged_decode_attention_equals_sdpa_over_each_request_s_keys(window):
    """One-token rows written to and read in place from a paged cache (scattered blocks, GQA 9/3
    heads) against torch's index_put for the write and scaled_dot_product_attention on each
    request's keys and values taken out by hand."""
    import dataclasses

    import torch.nn.functional as F

    from deepinfer_core.attention import AttentionKind, AttentionLayerSpec, AttentionMetadata
    from deepinfer_core.attention.torch_ref import write_kv
    from deepinfer_core.lowbit.attention import PagedDecodeAttention

    g = torch.Generator().manual_seed(5)
    hkv, heads, hd, bs, nb = 3, 9, 64, 16, 24
    spec = AttentionLayerSpec(kind=AttentionKind.FULL, layer_index=0, num_heads=heads, num_kv_heads=hkv,
                              head_dim=hd, v_head_dim=hd, scale=hd**-0.5, window=window)
    cache = torch.randn(2, hkv, nb, bs, hd, generator=g)
    positions = torch.tensor([0, 5, 40, 70])  # the new token's position = context length - 1
    tables = torch.randperm(nb, generator=g)[:20].reshape(4, 5).int()  # each request's blocks
    q = torch.randn(4, heads, hd, generator=g)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(5, dtype=torch.int32), seq_lens=(positions + 1).int(), positions=positions,
        slot_mapping=torch.zeros(4, dtype=torch.long), block_tables=tables, block_size=bs, max_query_len=1,
        max_seq_len=int(positions.max()) + 1,
    )  # fmt: skip
    new_k, new_v = torch.randn(2, 4, hkv, hd, generator=g)  # the new tokens' K and V, written first
    slots = torch.stack([tables[r, p // bs].long() * bs + p % bs for r, p in enumerate(positions.tolist())])
    meta = dataclasses.replace(meta, slot_mapping=slots)
    expected_cache = cache.clone()
    write_kv(spec, new_k, new_v, expected_cache, slots)  # the reference backend's write (index_put)
    out = PagedDecodeAttention(KERNELS.lib).forward(spec, q, new_k, new_v, cache, meta)
    assert torch.equal(cache, expected_cache)
    for r, pos in enumerate(positions.tolist()):
        first = 0 if window is None else max(0, pos - window + 1)
        slots = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for p in range(first, pos + 1)])
        k = cache[0].reshape(hkv, nb * bs, hd)[:, slots]  # [Hkv, n, D]
        v = cache[1].reshape(hkv, nb * bs, hd)[:, slots]
        ref = F.scaled_dot_product_attention(q[r][:, None], k, v, scale=spec.scale, enable_gqa=True)[:, 0]  # [H, D]
        torch.testing.assert_close(out[r], ref, rtol=1e-5, atol=1e-5)

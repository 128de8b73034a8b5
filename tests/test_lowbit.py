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
from deepinfer_core.lowbit.formats import QuantWeight, from_gguf  # noqa: E402

KERNELS = native.load()
needs_kernels = pytest.mark.skipif(KERNELS.lib is None, reason=f"low-bit kernels unavailable here: {KERNELS.reason}")


def _random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw bytes of a [n, k] tensor of ``type_name``: random quants, sane f16 scales."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scales = np.frombuffer(np.full(2, 0.01, np.float16).tobytes(), np.uint8)  # two f16 values
    if type_name in ("Q4_K", "Q5_K", "Q4_1", "Q5_1"):  # d, dmin (or m) first
        raw[..., 0:4] = scales
    elif type_name == "Q6_K":  # d last
        raw[..., -2:] = scales[:2]
    else:  # d first
        raw[..., 0:2] = scales[:2]
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_gguf_quantized_tensors_pack_exactly(type_name):
    w = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    packed = from_gguf(type_name, raw, (48, 256))
    assert packed.kind == {"Q8_0": "q8", "Q5_0": "q5", "Q5_1": "q5"}.get(type_name, "q4")
    assert np.array_equal(packed.dequantize().numpy(), expected)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_q5_random_blocks_pack_exactly(type_name):
    """Every high-bit pattern (random qh words, not a quantizer's), and the 5-bit values read
    back as gguf dequantizes them."""
    raw = _random_blocks(type_name, 8, 512, seed=11)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    packed = from_gguf(type_name, raw, (8, 512))
    assert packed.kind == "q5" and packed.qs.shape == (8, 16, 20)
    assert np.array_equal(packed.dequantize().numpy(), expected)


def test_q4_k_super_blocks_pack_exactly():
    raw = _random_blocks("Q4_K", 8, 512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    packed = from_gguf("Q4_K", raw, (8, 512))
    assert packed.kind == "q4" and np.array_equal(packed.dequantize().numpy(), expected)


def test_q5_k_super_blocks_pack_exactly():
    raw = _random_blocks("Q5_K", 8, 512, seed=12)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K)
    packed = from_gguf("Q5_K", raw, (8, 512))
    assert packed.kind == "q5" and np.array_equal(packed.dequantize().numpy(), expected)


@pytest.mark.parametrize("type_name", ["Q6_K"])
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
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1"])
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


@needs_kernels
def test_exact_kernel_over_several_token_chunks_equals_each_row_alone_and_float64():
    """Prefill-sized calls run the tokens in L2-sized chunks (K = 512: 128 tokens each, so 300
    rows are chunks of 128, 128 and 44, the last ending in 2 single tokens): still each row's
    result bit for bit, and the float64 product with the dequantized weights."""
    w = np.random.default_rng(9).standard_normal((21, 512)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    packed = from_gguf("Q4_1", raw, (21, 512))
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).copy())
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(5))
    together = ops.matmul(x, packed)
    torch.testing.assert_close(together, (x.double() @ dense.double().T).float(), rtol=1e-5, atol=1e-4)
    for i in (0, 127, 128, 255, 256, 298, 299):
        assert torch.equal(ops.matmul(x[i : i + 2], packed)[0], together[i])


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
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("hd", [64, 20, 128])
@pytest.mark.parametrize("heads_kv", [(9, 3), (8, 2), (4, 4), (6, 3)])
def test_paged_decode_attention_equals_sdpa_over_each_request_s_keys(window, cache_dtype, hd, heads_kv):
    """One-token rows written to and read in place from a paged cache (scattered blocks, GQA 9/3,
    8/2, 6/3 and 4/4 heads; a float32 or float16 cache; head widths 64 and 128 (the compiled-shape
    kernel) and 20 (the general one); contexts of 1 to 71 tokens)
    against torch's index_put for the write (float16: torch's rounding of each value) and
    scaled_dot_product_attention in float32 on each request's keys and values taken out by hand."""
    import dataclasses

    import torch.nn.functional as F

    from deepinfer_core.attention import AttentionKind, AttentionLayerSpec, AttentionMetadata
    from deepinfer_core.attention.torch_ref import write_kv
    from deepinfer_core.lowbit.attention import PagedDecodeAttention

    g = torch.Generator().manual_seed(5)
    (heads, hkv), bs, nb = heads_kv, 16, 24
    spec = AttentionLayerSpec(
        kind=AttentionKind.FULL,
        layer_index=0,
        num_heads=heads,
        num_kv_heads=hkv,
        head_dim=hd,
        v_head_dim=hd,
        scale=hd**-0.5,
        window=window,
    )
    cache = torch.randn(2, hkv, nb, bs, hd, generator=g).to(cache_dtype)
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
        k = cache[0].reshape(hkv, nb * bs, hd)[:, slots].float()  # [Hkv, n, D]
        v = cache[1].reshape(hkv, nb * bs, hd)[:, slots].float()
        ref = F.scaled_dot_product_attention(q[r][:, None], k, v, scale=spec.scale, enable_gqa=True)[:, 0]  # [H, D]
        torch.testing.assert_close(out[r], ref, rtol=1e-5, atol=1e-5)


def _act16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integer kernel's own rounding of x [M, K]: (v int16 [M, K], s [M, K/32], block sums)."""
    M, K = x.shape
    v, s, sx = torch.empty(M, K, dtype=torch.int16), torch.empty(M, K // 32), torch.empty(M, K // 32)
    KERNELS.lib.quantize_act16(x.data_ptr(), M, K, v.data_ptr(), s.data_ptr(), sx.data_ptr())
    return v, s, sx


@needs_kernels
@pytest.mark.parametrize(("quantize", "dtype", "top", "slack"), [
    # float32's rounding of x * (32767 / max): up to 32767 * 2^-23 steps more
    ("quantize_act16", torch.int16, 32767, 0.505),
    ("quantize_act8", torch.int8, 127, 0.501),  # the int8 kernel (kernels_i8.c)
])  # fmt: skip
def test_activations_are_each_block_rounded_to_half_a_step(quantize, dtype, top, slack):
    """The integer kernels' own rounding of x per 32-block, against float64 from x alone."""
    x = torch.randn(3, 352, generator=torch.Generator().manual_seed(6))
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    x[2, 5] = 300.0  # an outlier only widens its own block's step
    v, s, sx = torch.empty(3, 352, dtype=dtype), torch.empty(3, 11), torch.empty(3, 11)
    getattr(KERNELS.lib, quantize)(x.data_ptr(), 3, 352, v.data_ptr(), s.data_ptr(), sx.data_ptr())
    blocks = x.double().reshape(3, 11, 32)
    amax = blocks.abs().amax(-1)
    torch.testing.assert_close(s.double(), amax / top, rtol=1e-6, atol=0)
    assert v.abs().max() <= top and v[1, 32:64].eq(0).all() and s[1, 1] == 0
    err = (blocks - v.double().reshape(3, 11, 32) * s.double()[..., None]).abs()
    assert (err <= s.double()[..., None] * slack).all()  # half a step
    assert (
        v.reshape(3, 11, 32).abs().amax(-1)[amax > 0] == top
    ).all()  # the block's largest |x| is the full step count
    torch.testing.assert_close(sx.double(), blocks.sum(-1), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K"])
@pytest.mark.parametrize("M", [1, 3, 7, 17, 33])
def test_int16_kernel_equals_float64_sums_of_its_own_integers(type_name, M):
    """Odd shapes (N = 37 rows: two 16-row panel tiles and a short one; K = 11 blocks or 2 Q4_K
    super-blocks; M = 1 and 3 on the rows layout, 7, 17 and 33 on the panel, none a multiple of
    its 3- or 4-token tile): the kernel's result against float64 sums of the same integers times
    the same scales, the q4 offsets applied to the float block sums."""
    k = 512 if type_name.endswith("_K") else 352
    if type_name.endswith("_K"):  # the gguf library has no K-quant quantizer: random super-blocks
        raw = _random_blocks(type_name, 37, k, seed=7)
    else:
        w = np.random.default_rng(7).standard_normal((37, k)).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    packed = from_gguf(type_name, raw, (37, k))
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)) * 3
    x[:, 7] *= 20
    v, s, sx = _act16(x)
    nb = k // 32
    if packed.kind == "q8":
        q = packed.qs.long()
    else:  # the packed layout (formats.py; its dequantization equals gguf's: the tests above)
        q = torch.cat([packed.qs[..., :16] & 0x0F, packed.qs[..., :16] >> 4], dim=-1).long()  # [N, nb, 32]
        if packed.kind == "q5":
            qh = sum(packed.qs[..., 16 + i].long() << (8 * i) for i in range(4))  # [N, nb]
            q = q | (((qh[..., None] >> torch.arange(32)) & 1) << 4)
    ints = torch.einsum("nbj,mbj->mnb", q, v.long().reshape(M, nb, 32))  # exact integer block sums
    terms = ints.double() * packed.d.double()[None] * s.double()[:, None, :]
    if packed.m is not None:
        terms = terms + packed.m.double()[None] * sx.double()[:, None, :]
    expected = terms.sum(-1)
    got = ops.matmul(x, packed, max_int_rows=M)
    assert got.shape == (M, 37)
    bound = 1e-6 * terms.abs().sum(-1) + 1e-6  # float32 accumulation of the per-block terms only
    assert ((got.double() - expected).abs() <= bound).all(), float((got.double() - expected).abs().max())
    # and it is the float32 product up to the activations' rounding (1/65534 of each block's max)
    dense = packed.dequantize().double()
    step = x.double().reshape(M, nb, 32).abs().amax(-1) / 32767  # [M, nb]
    slack = (step[:, None, :] * 0.5 * dense.abs().reshape(37, nb, 32).sum(-1)[None]).sum(-1)
    assert ((got.double() - x.double() @ dense.T).abs() <= slack + bound).all()


@needs_kernels
@pytest.mark.parametrize("kind", ["q4", "q5", "q8"])
@pytest.mark.parametrize(("M", "K"), [(1, 352), (3, 352), (6, 352), (17, 352), (33, 352), (33, 1376)])
def test_int16_kernel_integer_sums_are_exact(kind, M, K):
    """Bit for bit: weights with d = 1 (and m = 0) and activations whose every block holds
    32767 (so the block's scale is exactly 1 and the integers are x itself) make each output the
    plain integer dot product, small enough to be exact in float32. That is, the kernel pairs
    every weight with its own activation (the panel's transposes, the short last tile of N = 37,
    the token tails, K = 1,376 in three slices of the panel) and loses nothing in its int32
    sums; int64 sums are the reference."""
    N = 37
    g = torch.Generator().manual_seed(M)
    lo, hi = {"q4": (0, 16), "q5": (0, 32), "q8": (-128, 128)}[kind]
    q = torch.randint(lo, hi, (N, K // 32, 32), generator=g)
    q[:, :, 5] = 0  # the weight of each block's largest activation (below): every sum stays far below 2^24
    if kind == "q4":
        qs = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        packed = QuantWeight("q4", qs, torch.ones(N, K // 32), torch.zeros(N, K // 32), "Q4_1")
    elif kind == "q5":  # ggml's Q5_1 block bytes (d, m, qh, qs) built here, packed by from_gguf
        nib = ((q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)).to(torch.uint8)
        qh = ((q >> 4) << torch.arange(32)).sum(-1).to(torch.int64)  # [N, nb] uint32 values
        qh_bytes = torch.stack([(qh >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)
        one_zero = torch.tensor([1.0, 0.0], dtype=torch.float16).view(torch.uint8).expand(N, K // 32, 4)
        raw = torch.cat([one_zero, qh_bytes, nib], dim=-1).reshape(N, -1).numpy()
        packed = from_gguf("Q5_1", raw, (N, K))
    else:
        packed = QuantWeight("q8", q.to(torch.int8), torch.ones(N, K // 32), None, "Q8_0")
    x = torch.randint(-40, 41, (M, K), generator=g).float()
    x[:, 5::32] = 32767.0  # each block's largest |x|: its scale is 32767 / 32767 = 1
    expected = torch.einsum("nbj,mbj->mn", q.long(), x.long().reshape(M, K // 32, 32))
    assert expected.abs().max() < 2**24
    got = ops.matmul(x, packed, max_int_rows=M)
    assert torch.equal(got, expected.float())


@needs_kernels
def test_int16_kernel_gives_each_row_the_same_result_within_each_layout():
    """A row's result does not depend on its batch within a layout: the rows layout (1-4 rows)
    and the panel (5 rows on, any token tail). Between the layouts only the float rounding of
    the same exact block sums differs."""
    w = np.random.default_rng(8).standard_normal((40, 256)).astype(np.float32)
    packed = from_gguf("Q4_1", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), (40, 256))
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(1))
    together = ops.matmul(x, packed, max_int_rows=19)  # the panel: 6 passes of 3 tokens and a tail of 1
    for lo, hi in ((0, 5), (3, 10), (11, 19), (13, 19)):  # tails of 2, 1, 2 and 0 tokens; other offsets
        assert torch.equal(ops.matmul(x[lo:hi], packed, max_int_rows=19), together[lo:hi])
    alone = torch.stack([ops.matmul(x[i : i + 1], packed, max_int_rows=1)[0] for i in range(19)])
    assert torch.equal(ops.matmul(x[4:8], packed, max_int_rows=4), alone[4:8])  # the rows layout
    torch.testing.assert_close(alone, together, rtol=1e-5, atol=1e-5)


def test_int_rows_setting_is_read_from_the_environment_and_refused_by_name():
    assert ops.int_rows({}) == ops.DEFAULT_INT_ROWS > 0
    assert ops.int_rows({"DEEPINFER_LOWBIT_EXACT": "1", "DEEPINFER_LOWBIT_INT_ROWS": "9"}) == 0
    assert ops.int_rows({"DEEPINFER_LOWBIT_INT_ROWS": "0"}) == 0
    assert ops.int_rows({"DEEPINFER_LOWBIT_INT_ROWS": "32"}) == 32
    with pytest.raises(ValueError, match="DEEPINFER_LOWBIT_INT_ROWS='-2'.*whole number >= 0"):
        ops.int_rows({"DEEPINFER_LOWBIT_INT_ROWS": "-2"})
    with pytest.raises(ValueError, match="DEEPINFER_LOWBIT_INT_ROWS='many'"):
        ops.int_rows({"DEEPINFER_LOWBIT_INT_ROWS": "many"})


def test_kv_cache_dtype_setting_is_read_from_the_environment_and_refused_by_name(monkeypatch):
    from deepinfer_core.lowbit.attention import KV_ENV, kv_dtype

    monkeypatch.delenv(KV_ENV, raising=False)
    assert kv_dtype() == torch.float16
    # the default follows the packed weights: all 8-bit -> float32, any narrower one -> float16
    assert kv_dtype(frozenset({"Q8_0"})) == torch.float32
    assert kv_dtype(frozenset({"Q4_1", "Q8_0"})) == torch.float16
    assert kv_dtype(frozenset({"Q4_K", "Q6_K"})) == torch.float16
    monkeypatch.setenv(KV_ENV, "float16")
    assert kv_dtype(frozenset({"Q8_0"})) == torch.float16  # the setting wins
    monkeypatch.setenv(KV_ENV, "float32")
    assert kv_dtype() == torch.float32
    assert kv_dtype(frozenset({"Q4_1"})) == torch.float32
    monkeypatch.setenv(KV_ENV, "bf16")
    with pytest.raises(ValueError, match="DEEPINFER_LOWBIT_KV_DTYPE='bf16': allowed values are float16, float32"):
        kv_dtype()

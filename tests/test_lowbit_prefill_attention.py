"""The native prefill's attention (lowbit/prefill_attention.c) against float64 softmax attention
over each row's keys and values taken out by hand: prompt runs that start at position 0, that
resume after keys already in the cache (an earlier chunk, a prefix-cache hit), single decode rows
among them, a run longer than one work item (16 rows), GQA 9/3 and 8/2, a sliding window, a
float32 and a float16 cache. Mode 2 must use the call's own keys and values unrounded and the
cache's for earlier positions; mode 1 every key and value as the cache holds it."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.lowbit import native

KERNELS = native.load()
pytestmark = pytest.mark.skipif(KERNELS.lib is None, reason=f"low-bit kernels unavailable here: {KERNELS.reason}")


def _run(mode: int, cache_dtype: torch.dtype, window: int | None, heads: int, hkv: int, hd: int = 64):
    g = torch.Generator().manual_seed(11)
    bs, nb = 16, 48
    # (earlier positions in the cache, rows in the call) per request, in call order
    runs = [(0, 37), (50, 1), (21, 19), (0, 1), (130, 5)]
    R = sum(n for _, n in runs)
    tables = torch.randperm(nb, generator=g)[: 5 * 9].reshape(5, 9).int()
    cache = torch.zeros(2, hkv, nb, bs, hd, dtype=cache_dtype)
    k_rows, v_rows = torch.randn(2, R, hkv, hd, generator=g)  # the call's keys and values, float32
    q = torch.randn(R, heads, hd, generator=g)
    positions, row_tables, keys, values = [], [], [], []  # keys[r]: [hkv, n, hd] float64 as row r must see them
    row = 0
    for req, (before, n) in enumerate(runs):
        slot = lambda p: (int(tables[req, p // bs]), p % bs)  # noqa: E731
        old_k, old_v = torch.randn(2, before, hkv, hd, generator=g)
        for p in range(before):  # earlier positions: already in the cache
            b, o = slot(p)
            cache[0, :, b, o], cache[1, :, b, o] = old_k[p], old_v[p]
        for i in range(n):  # the call writes its rows before attending (as layer.c does)
            b, o = slot(before + i)
            cache[0, :, b, o], cache[1, :, b, o] = k_rows[row + i], v_rows[row + i]
        cached_k = torch.cat([old_k, k_rows[row : row + n]]).to(cache_dtype).double()  # what the cache holds
        cached_v = torch.cat([old_v, v_rows[row : row + n]]).to(cache_dtype).double()
        if mode == 2:  # the call's own rows as computed
            cached_k[before:], cached_v[before:] = k_rows[row : row + n].double(), v_rows[row : row + n].double()
        for i in range(n):
            pos = before + i
            first = 0 if window is None else max(0, pos - window + 1)
            positions.append(pos)
            row_tables.append(tables[req])
            keys.append(cached_k[first : pos + 1].transpose(0, 1))
            values.append(cached_v[first : pos + 1].transpose(0, 1))
        row += n
    positions_t, tables_t = torch.tensor(positions), torch.stack(row_tables).contiguous()
    out = torch.full((R, heads, hd), float("nan"))
    KERNELS.lib.prefill_attention(
        q.data_ptr(), k_rows.data_ptr(), hkv * hd, v_rows.data_ptr(), hkv * hd, cache.data_ptr(), hkv, nb, bs, hd,
        heads, hd, tables_t.data_ptr(), tables_t.shape[1], positions_t.data_ptr(), R, hd**-0.5, window or 0,
        out.data_ptr(), 2, cache_dtype == torch.float16, mode,
    )  # fmt: skip
    assert KERNELS.lib.prefill_has_runs(positions_t.data_ptr(), tables_t.data_ptr(), tables_t.shape[1], R) == 1
    group = heads // hkv
    for r in range(R):
        k, v = keys[r].repeat_interleave(group, 0), values[r].repeat_interleave(group, 0)  # [H, n, hd]
        probs = torch.softmax((q[r].double()[:, None] * k).sum(-1) * hd**-0.5, dim=-1)  # [H, n]
        expected = (probs[..., None] * v).sum(1)
        torch.testing.assert_close(
            out[r].double(), expected, rtol=1e-5, atol=2e-6, msg=f"row {r}, position {positions[r]}"
        )


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "heads", "hkv"), [(None, 9, 3), (23, 8, 2)])
def test_prefill_attention_equals_float64_softmax_attention_over_each_row_s_keys(mode, cache_dtype, window, heads, hkv):
    _run(mode, cache_dtype, window, heads, hkv)


def test_rows_of_one_token_each_are_no_runs():
    positions = torch.tensor([4, 5, 9])
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)  # 4 and 5 follow, but in other requests
    assert KERNELS.lib.prefill_has_runs(positions.data_ptr(), tables.data_ptr(), 2, 3) == 0


def test_the_mode_setting_is_read_from_the_environment_and_refused_by_name(monkeypatch):
    from deepinfer_core.builtin.lowbit import llama_decode

    assert llama_decode.prefill_attention_mode() == 2
    monkeypatch.setenv("DEEPINFER_PREFILL_ATTENTION", "0")
    assert llama_decode.prefill_attention_mode() == 0
    monkeypatch.setenv("DEEPINFER_PREFILL_ATTENTION", "f32")
    with pytest.raises(ValueError, match="DEEPINFER_PREFILL_ATTENTION='f32': allowed values are 2 .* 1 .* and 0"):
        llama_decode.prefill_attention_mode()

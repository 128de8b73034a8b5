"""Decode and prefill attention (lowbit/attention.c, prefill_attention.c) give the same bits in
the AVX2 build and the AVX512 build (deepinfer_core.lowbit.native).

The AVX512 build runs 512-bit loops (two positions' 8-lane score accumulators per register, 16
output columns per weighted-sum vector) that keep every output's operations and their order; the
AVX2 build is the kernel as it was before them, so every output must be bit-for-bit equal: float32,
float16 and int8 caches, 1-5 query heads per KV head, head widths 64 and 128 (the compiled shapes)
and 32 and 80 (the general loop), windows, contexts of 1 to 257 tokens (every remainder of 4 and
8), one and two threads.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer_core.lowbit import native

BASE = native.load_isa("avx2")
HAS_512 = all(f in native.cpu_flags() for f in ("avx512f", "avx512vl", "avx512bw", "avx512_vnni"))
WIDE = native.load_isa("avx512vnni") if HAS_512 and BASE.lib is not None else None
needs_both = pytest.mark.skipif(
    WIDE is None or WIDE.lib is None, reason="this CPU lacks AVX512 (or a build failed): nothing to compare"
)

BS, HKV = 16, 2
CONTEXTS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 15, 16, 17, 31, 64, 100, 191, 192, 257]
KV = {"float32": 0, "float16": 1, "int8": 2}


def _cache(kind: str, D: int, blocks: int, g: torch.Generator) -> torch.Tensor:
    if kind != "int8":
        return torch.randn(2, HKV, blocks, BS, D, generator=g).to(getattr(torch, kind))
    cache = torch.empty(2, HKV, blocks, BS, D + 4, dtype=torch.int8)
    k, v = torch.randn(2, blocks * BS, HKV, D, generator=g)
    slots = torch.arange(blocks * BS)
    BASE.lib.paged_write_kv(
        k.data_ptr(), v.data_ptr(), cache.data_ptr(), HKV, blocks, BS, D + 4, D, D, slots.data_ptr(), blocks * BS, 2
    )
    return cache


@needs_both
@pytest.mark.parametrize("kind", ["float32", "float16", "int8"])
@pytest.mark.parametrize("D", [64, 128, 32, 80])
def test_decode_attention_bits_equal_between_builds(kind, D):
    g = torch.Generator().manual_seed(D)
    R, per = len(CONTEXTS), -(-max(CONTEXTS) // BS)
    blocks = R * per + 1
    cache = _cache(kind, D, blocks, g)
    tables = torch.randperm(blocks, generator=g)[: R * per].reshape(R, per).int()
    positions = torch.tensor(CONTEXTS) - 1
    for G, window, threads in itertools.product((1, 2, 3, 4, 5), (0, 37), (1, 2)):
        q = torch.randn(R, HKV * G, D, generator=g)
        outs = []
        for lib in (BASE.lib, WIDE.lib):
            out = torch.full((R, HKV * G, D), float("nan"))
            lib.paged_decode_attention(q.data_ptr(), cache.data_ptr(), HKV, blocks, BS, cache.shape[-1], HKV * G, D, D,
                                       tables.data_ptr(), per, positions.data_ptr(), R, D**-0.5, window, out.data_ptr(),
                                       threads, KV[kind])  # fmt: skip
            outs.append(out)
        assert not outs[0].isnan().any()
        assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), (G, window, threads)

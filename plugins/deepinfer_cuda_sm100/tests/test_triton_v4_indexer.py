"""The Triton lightning-indexer scores of DeepSeek-V4's CSA layers: against a float64 loop
written here, and the core's ``Indexer.select`` choosing the same entries with the kernel's
scores as with its own torch path (prefill over a cached prefix and decode, several requests
over a shuffled block table). Interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.models.deepseek_v4.batch import V4Batch  # noqa: E402
from deepinfer_core.models.deepseek_v4.compress import Indexer  # noqa: E402
from deepinfer_core.models.deepseek_v4.config import parse_config  # noqa: E402
from deepinfer_core.models.deepseek_v4.kv import V4LayerCache  # noqa: E402
from deepinfer_core.models.deepseek_v4.layers import V4Rope  # noqa: E402
from deepinfer_core.testing.paged_batch import scattered_batch  # noqa: E402
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG  # noqa: E402
from deepinfer_cuda_sm100.attention import TritonV4Attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO, BLOCK, D = 4, 32, 64


def _setup(ends, news, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cfg = parse_config(dict(TINY_V4_CONFIG) | {"index_n_heads": 16, "index_head_dim": 32, "index_topk": 5})
    indexer = Indexer(cfg, RATIO)
    for p in indexer.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    indexer = indexer.to(DEVICE, dtype).requires_grad_(False)
    paged = scattered_batch(ends, news, block_size=BLOCK, generator=g, spare_blocks=3)
    tables = paged.block_tables
    entries = torch.randn(int(tables.max()) + 1, BLOCK // RATIO, D + cfg.index_head_dim, generator=g).to(DEVICE, dtype)
    cache = V4LayerCache(entries=entries, window=entries.new_zeros(1, 1, D), tail=entries.new_zeros(1, 0, 0))
    bounds = paged.query_start_loc.tolist()
    ranges = tuple(zip(bounds[:-1], bounds[1:]))
    starts = tuple(e - n for e, n in zip(ends, news))
    batch = V4Batch(ranges, starts, tuple(range(len(ends))), tables.to(DEVICE), BLOCK, prompt_lens=tuple(ends))
    positions = paged.positions.to(DEVICE)
    meta = paged.metadata(
        DEVICE, slot_mapping=torch.zeros_like(positions), state_slots=torch.arange(len(ends), device=DEVICE)
    )
    scorer = functools.partial(TritonV4Attention().index_scores, meta=meta)
    x = torch.randn(paged.num_tokens, cfg.hidden_size, generator=g).to(DEVICE, dtype)
    q_residual = torch.randn(paged.num_tokens, cfg.q_lora_rank, generator=g).to(DEVICE, dtype)
    rope = V4Rope(cfg.rope_dim, cfg.compress_rope, cfg.max_position_embeddings, DEVICE)
    return indexer, cache, batch, positions, x, q_residual, rope, scorer


def test_scores_match_a_float64_loop():
    indexer, cache, batch, positions, x, q_residual, rope, kernel = _setup([37, 9, 64], [37, 1, 20])
    seen = {}

    def scorer(*args):
        seen["out"] = kernel(*args)
        seen["args"] = args
        return seen["out"]

    indexer.select(x, q_residual, positions, cache, batch, rope, D, scorer)
    q, weights, entries, key_col, pos, _batch, ratio, n_max, scale = seen["args"]
    assert n_max == 64 // RATIO
    want = torch.full((q.shape[0], n_max), float("-inf"), dtype=torch.float64)
    for r, (a, b) in enumerate(batch.token_ranges):
        for t in range(a, b):
            for w in range((int(pos[t]) + 1) // ratio):
                block = int(batch.block_tables[r, w // (BLOCK // RATIO)])
                key = entries[block, w % (BLOCK // RATIO), key_col : key_col + q.shape[-1]].double()
                want[t, w] = sum(
                    float(weights[t, h]) * max(0.0, float(q[t, h].double() @ key)) * scale for h in range(q.shape[1])
                )
    torch.testing.assert_close(seen["out"].double().cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_select_chooses_the_same_entries_with_the_kernel_scores(dtype):
    for ends, news in (([37, 9, 64], [37, 1, 20]), ([41, 80, 13], [1, 1, 1])):
        indexer, cache, batch, positions, x, q_residual, rope, scorer = _setup(
            ends, news, seed=len(news) + sum(news), dtype=dtype
        )
        want = indexer.select(x, q_residual, positions, cache, batch, rope, D)
        got = indexer.select(x, q_residual, positions, cache, batch, rope, D, scorer)
        assert (want >= 0).any()
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)

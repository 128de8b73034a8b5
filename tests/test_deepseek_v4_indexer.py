"""DeepSeek-V4's lightning indexer when a row ranks no more than ``index_topk`` entries: it
chooses every visible entry (the set top-k returns; attention sums over the set) without
scoring anything. The scored path is checked against transformers by test_deepseek_v4.py."""

from __future__ import annotations

import torch

from deepinfer_core.models.deepseek_v4.batch import V4Batch
from deepinfer_core.models.deepseek_v4.compress import Indexer
from deepinfer_core.models.deepseek_v4.config import parse_config
from deepinfer_core.models.deepseek_v4.kv import V4LayerCache
from deepinfer_core.models.deepseek_v4.layers import V4Rope
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG


def test_rows_ranking_at_most_topk_entries_choose_every_visible_one_unscored():
    cfg = parse_config(dict(TINY_V4_CONFIG) | {"index_topk": 12})
    indexer = Indexer(cfg, 4).requires_grad_(False)

    def refuse(*_):
        raise AssertionError("scored although no row ranks more than index_topk entries")

    indexer.q_b_proj.forward = refuse
    ends, news = (48, 9, 30), (48, 1, 7)  # a prompt of 12 entries, a decode at 2, a chunk up to 7
    ranges, starts, a = [], [], 0
    for e, n in zip(ends, news):
        ranges.append((a, a + n))
        starts.append(e - n)
        a += n
    batch = V4Batch(
        tuple(ranges), tuple(starts), (0, 1, 2), torch.zeros(3, 1, dtype=torch.int32), 128, prompt_lens=(48, 4, 30)
    )
    positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])
    cache = V4LayerCache(
        torch.zeros(1, 32, cfg.head_dim + cfg.index_head_dim), torch.zeros(1, 1, 1), torch.zeros(1, 0, 0)
    )
    rope = V4Rope(cfg.rope_dim, cfg.compress_rope, cfg.max_position_embeddings)
    out = indexer.select(
        torch.zeros(a, cfg.hidden_size),
        torch.zeros(a, cfg.q_lora_rank),
        positions,
        cache,
        batch,
        rope,
        cfg.head_dim,
        refuse,
    )
    for t, p in enumerate(positions.tolist()):
        chosen = sorted(w for w in out[t].tolist() if w >= 0)
        assert chosen == list(range((p + 1) // 4)), f"position {p}"

"""DeepSeek-V4's batched general step (``deepseek_v4_prefill``): a batch of mixed requests writes
the same compressed entries and state tails and the indexer chooses the same entries as each
request run alone. The requests: a prompt shorter than one window, one of exactly one window,
one of several, one chunked at a position that is not a window boundary, and decode rows after
a prompt; two index heads make exact score ties (relu zeros) common, so top-k's tie-breaking is
checked too. Agreement with transformers is test_deepseek_v4.py's (whole model)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.models.deepseek_v4.compress import Compressor, Indexer, V4Batch, update_entries
from deepinfer_core.models.deepseek_v4.config import parse_config
from deepinfer_core.models.deepseek_v4.kv import V4LayerCache
from deepinfer_core.models.deepseek_v4.layers import V4Rope
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG

CFG = parse_config(dict(TINY_V4_CONFIG) | {"index_n_heads": 2, "index_topk": 3})
BLOCK, D = 32, 64
PROMPTS = (3, 4, 37, 64, 100)  # tokens; request 3 is prefilled in chunks of 30 and 34
STEPS = (  # per step, (request, tokens scheduled)
    ((0, 3), (1, 4), (2, 37), (3, 30), (4, 100)),
    ((0, 1), (1, 1), (2, 1), (3, 34), (4, 1)),
    ((0, 1), (2, 1), (3, 1), (4, 1)),
)


def _layer(ratio: int, csa: bool):
    g = torch.Generator().manual_seed(ratio)
    parts = [(Compressor(CFG.hidden_size, D, ratio, csa, CFG.rms_norm_eps), 0)]
    if csa:
        parts.append((Indexer(CFG, ratio), D))
    for comp, _ in parts:
        for p in comp.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.3
        comp.requires_grad_(False)
    return parts


def _inputs(parts, length: int, request: int):
    """Per position of a request, its projections and layer inputs, whatever the batching."""
    g = torch.Generator().manual_seed(100 + request)
    raw = [torch.randn(length, 2 * comp.width, generator=g) for comp, _ in parts]
    return raw, torch.randn(length, CFG.hidden_size, generator=g), torch.randn(length, CFG.q_lora_rank, generator=g)


def _run(parts, requests: list[int], ratio: int, csa: bool):
    """Runs STEPS for ``requests`` only; returns the cache and each request's chosen entries per step."""
    width = sum(2 * comp.width for comp, _ in parts)
    cache = V4LayerCache(
        entries=torch.zeros(40, BLOCK // ratio, D + (CFG.index_head_dim if csa else 0)),
        window=torch.zeros(len(PROMPTS), 1, D),
        tail=torch.zeros(len(PROMPTS), 2 * ratio if csa else ratio, width),
    )
    tables = (
        torch.randperm(40, generator=torch.Generator().manual_seed(1))[: len(PROMPTS) * 8].view(len(PROMPTS), 8).int()
    )
    rope = V4Rope(CFG.rope_dim, CFG.compress_rope, CFG.max_position_embeddings)
    inputs = [_inputs(parts, PROMPTS[r] + 3, r) for r in range(len(PROMPTS))]
    done = [0] * len(PROMPTS)
    chosen: dict[tuple[int, int], torch.Tensor] = {}
    for step, scheduled in enumerate(STEPS):
        scheduled = [(r, n) for r, n in scheduled if r in requests]
        if not scheduled:
            continue
        ranges, a = [], 0
        for _, n in scheduled:
            ranges.append((a, a + n))
            a += n
        rs = [r for r, _ in scheduled]
        batch = V4Batch(
            tuple(ranges),
            tuple(done[r] for r in rs),
            tuple(rs),
            tables[rs],
            BLOCK,
            prompt_lens=tuple(PROMPTS[r] for r in rs),
        )
        rows = [slice(done[r], done[r] + n) for r, n in scheduled]
        raw = [torch.cat([inputs[r][0][i][sl] for r, sl in zip(rs, rows)]) for i in range(len(parts))]
        update_entries(parts, raw, cache, batch, rope)
        if csa:
            x = torch.cat([inputs[r][1][sl] for r, sl in zip(rs, rows)])
            q_residual = torch.cat([inputs[r][2][sl] for r, sl in zip(rs, rows)])
            positions = torch.cat([torch.arange(sl.start, sl.stop) for sl in rows])
            out = parts[1][0].select(x, q_residual, positions, cache, batch, rope, D)
            for r, (lo, hi) in zip(rs, ranges):
                chosen[r, step] = out[lo:hi].sort(dim=1).values
        for r, n in scheduled:
            done[r] += n
    return cache, tables, chosen


@pytest.mark.parametrize(("ratio", "csa"), [(4, True), (8, False)], ids=["csa", "hca"])
def test_mixed_batch_writes_and_chooses_as_each_request_alone(ratio, csa):
    parts = _layer(ratio, csa)
    everyone = list(range(len(PROMPTS)))
    cache, tables, chosen = _run(parts, everyone, ratio, csa)
    assert cache.entries.abs().sum() > 0
    for r in everyone:
        alone, _, alone_chosen = _run(parts, [r], ratio, csa)
        entries = -(-(PROMPTS[r] + 2) // BLOCK)  # the request's blocks
        assert torch.equal(cache.entries[tables[r, :entries].long()], alone.entries[tables[r, :entries].long()]), (
            f"request {r}"
        )
        assert torch.equal(cache.tail[r], alone.tail[r]), f"request {r}"
        for key, want in alone_chosen.items():
            got = chosen[key]
            width = min(got.shape[1], want.shape[1])  # a batch without ranking pads fewer -1 columns
            assert torch.equal(got[:, -width:], want[:, -width:]) and (got[:, :-width] == -1).all(), (
                f"request {r}, step {key[1]}"
            )


def test_layers_of_one_kind_share_the_forwards_plans(monkeypatch):
    """One StepPlans per forward: the second layer of a kind reuses the window plan the first
    built (one plan per kind and step, not per layer), and writes what it writes with a plan of
    its own."""
    from deepinfer_core.models.deepseek_v4 import compress as deepseek_v4_compress
    from deepinfer_core.models.deepseek_v4.compress import StepPlans

    built = []
    real = deepseek_v4_compress.window_plan
    monkeypatch.setattr(deepseek_v4_compress, "window_plan", lambda *a: built.append(1) or real(*a))
    parts = _layer(8, False)
    rope = V4Rope(CFG.rope_dim, CFG.compress_rope, CFG.max_position_embeddings)
    tables = torch.arange(16).view(2, 8).int()
    batch = V4Batch(((0, 37), (37, 37 + 20)), (0, 0), (0, 1), tables, BLOCK, prompt_lens=(37, 20))
    raw = [torch.randn(57, 2 * comp.width, generator=torch.Generator().manual_seed(3)) for comp, _ in parts]

    def cache():
        return V4LayerCache(
            entries=torch.zeros(16, BLOCK // 8, D),
            window=torch.zeros(2, 1, D),
            tail=torch.zeros(2, 8, 2 * parts[0][0].width),
        )

    plans, layers = StepPlans(), [cache(), cache()]
    for c in layers:
        update_entries(parts, raw, c, batch, rope, plans=plans)
    assert len(built) == 1
    alone = cache()
    update_entries(parts, raw, alone, batch, rope)
    assert len(built) == 2 and alone.entries.abs().sum() > 0
    for c in layers:
        assert torch.equal(c.entries, alone.entries) and torch.equal(c.tail, alone.tail)


def test_the_step_layout_comes_from_the_host_copies_the_batch_builder_attaches():
    """The engine's batch builder attaches the layout as host tuples when requests have state
    KV; DeepSeek-V4 takes its per-forward layout from them without reading the device tensors
    (here on the meta device, where a read fails), and gets the layout those tensors hold."""
    import dataclasses

    from deepinfer_core.engine.batch_build import build
    from deepinfer_core.engine.scheduler import ScheduledRequest, SchedulerOutput
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4ForCausalLM

    reqs = (
        ScheduledRequest("decode", (7,), start_position=40, block_ids=(0, 1, 2), sample=True, seed=0, prompt_len=30),
        ScheduledRequest(
            "chunk", tuple(range(10)), start_position=20, block_ids=(3, 4), sample=False, seed=0, prompt_len=50
        ),
        ScheduledRequest(
            "prompt", tuple(range(5)), start_position=0, block_ids=(5,), sample=True, seed=0, prompt_len=5
        ),
    )
    meta = build(SchedulerOutput(reqs, 16), 16, torch.device("cpu"), state_slots=[5, 2, 7]).meta
    assert (
        meta.host_query_start_loc == (0, 1, 11, 16)
        and meta.host_seq_lens == (41, 30, 5)
        and meta.host_state_slots == (5, 2, 7)
    )
    read_back = DeepseekV4ForCausalLM._batch(
        None, dataclasses.replace(meta, host_query_start_loc=None, host_seq_lens=None, host_state_slots=None)
    )
    unreadable = {
        f: torch.empty(getattr(meta, f).shape, dtype=getattr(meta, f).dtype, device="meta")
        for f in ("query_start_loc", "seq_lens", "state_slots")
    }
    host = DeepseekV4ForCausalLM._batch(None, dataclasses.replace(meta, **unreadable))
    assert host.token_ranges == read_back.token_ranges == ((0, 1), (1, 11), (11, 16))
    assert host.starts == read_back.starts == (40, 20, 0) and host.slots == read_back.slots == (5, 2, 7)
    assert host.prompt_lens == (30, 50, 5)

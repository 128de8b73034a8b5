"""The host-side counts a step's AttentionMetadata carries for backends that size work on the
context without a device sync (``num_context_tokens``, ``num_attention_pairs``; the cuda_sm100
plugin's choice of MLA's non-absorbed prefill reads them), counted here by hand."""

from __future__ import annotations

import torch

from deepinfer_core.engine.batch_build import build
from deepinfer_core.engine.scheduler import ScheduledRequest, SchedulerOutput


def test_context_tokens_and_causal_pairs_of_a_mixed_step():
    reqs = (
        ScheduledRequest(
            "decode", (7,), start_position=40, block_ids=(0, 1, 2), sample=True, seed=0
        ),  # 1 query over 41 keys
        ScheduledRequest(
            "chunk", tuple(range(10)), start_position=20, block_ids=(3, 4), sample=False, seed=0
        ),  # 10 over 21..30
        ScheduledRequest(
            "prompt", tuple(range(5)), start_position=0, block_ids=(5,), sample=True, seed=0
        ),  # 5 over 1..5
    )
    meta = build(SchedulerOutput(reqs, 16), 16, torch.device("cpu")).meta
    assert meta.num_context_tokens == 41 + 30 + 5 == int(meta.seq_lens.sum())
    assert meta.num_attention_pairs == 41 + sum(range(21, 31)) + sum(range(1, 6))

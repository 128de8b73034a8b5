"""The sampler's per-request logits-processor seam (what structured output plugs into)."""

import pytest
import torch

from deepinfer_core.engine.sampler import Sampler, SamplingRow
from deepinfer_core.engine.sampling_params import SamplingParams

V = 40


def only(token: int):
    def process(output_token_ids, logits):
        mask = torch.full_like(logits, float("-inf"))
        mask[token] = 0.0
        return logits + mask

    return process


def test_a_processor_changes_its_row_only():
    lg = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    free = lg.argmax(-1).tolist()
    forced = next(t for t in range(V) if t != free[1])
    rows = [
        SamplingRow(SamplingParams(temperature=0), 1, 5, [1], []),
        SamplingRow(SamplingParams(temperature=0, logits_processors=[only(forced)]), 1, 5, [1], []),
        SamplingRow(SamplingParams(temperature=0.8, seed=3, logits_processors=[only(7)]), 3, 5, [1], []),
    ]
    picked = Sampler()(lg.clone(), rows)
    assert picked == [free[0], forced, 7]


def test_a_processor_sees_the_tokens_generated_so_far():
    seen = []

    def record(output_token_ids, logits):
        seen.append(list(output_token_ids))
        return logits

    Sampler()(
        torch.zeros(1, V),
        [SamplingRow(SamplingParams(temperature=0, logits_processors=[record]), 1, 9, [1, 2], [4, 5, 6])],
    )
    assert seen == [[4, 5, 6]]


def test_processors_must_be_callables():
    with pytest.raises(TypeError, match="logits_processors"):
        SamplingParams(logits_processors=["not callable"])

"""Sampler behaviour: filters restrict the support, seeds reproduce, rows are independent."""

import pytest
import torch

from deepinfer_core.engine.sampler import Sampler, SamplingRow
from deepinfer_core.engine.sampling_params import SamplingParams

V = 50


def row(seed=1, position=10, prompt=(), output=(), **kw):
    return SamplingRow(SamplingParams(**kw), seed, position, list(prompt), list(output))


def logits(n=1, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def draws(lg, make_row, n=300):
    s = Sampler()
    return {s(lg.clone(), [make_row(seed=i)])[0] for i in range(n)}


def test_greedy_is_argmax():
    lg = logits(4)
    assert Sampler()(lg.clone(), [row(temperature=0)] * 4) == lg.argmax(-1).tolist()


def test_top_k_support():
    lg = logits()
    top = set(torch.topk(lg[0], 3).indices.tolist())
    got = draws(lg, lambda seed: row(seed=seed, temperature=1.0, top_k=3))
    assert got == top


def test_top_p_support_is_the_smallest_prefix_reaching_p():
    lg = logits()
    probs = lg[0].softmax(-1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    n_keep = int((cum < 0.6).sum()) + 1
    allowed = set(order[:n_keep].tolist())
    got = draws(lg, lambda seed: row(seed=seed, temperature=1.0, top_p=0.6), n=400)
    assert got <= allowed and len(got) == len(allowed)


@pytest.mark.parametrize("top_p", [1e-300, 1e-50, 1e-9])
def test_top_p_below_float32_range_still_keeps_the_most_likely_token(top_p):
    """The nucleus always holds the most likely token. A top_p that rounds to 0 in float32
    (1e-300, 1e-50) used to mask every token, and the NaN row sampled token 0."""
    lg = logits(seed=3)
    assert draws(lg, lambda seed: row(seed=seed, temperature=1.0, top_p=top_p), n=20) == {int(lg[0].argmax())}


def test_min_p_excludes_unlikely_tokens():
    lg = logits()
    probs = lg[0].softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    assert draws(lg, lambda seed: row(seed=seed, temperature=1.0, min_p=0.2)) <= allowed


def test_seed_and_position_determine_the_draw_not_the_batch():
    lg = logits(3)
    s = Sampler()
    alone = s(lg[1:2].clone(), [row(seed=42, position=7, temperature=1.0)])
    batched = s(
        lg.clone(), [row(seed=1, temperature=1.0), row(seed=42, position=7, temperature=1.0), row(temperature=0)]
    )
    assert batched[1] == alone[0]
    other_pos = {s(lg[1:2].clone(), [row(seed=42, position=p, temperature=1.0)])[0] for p in range(40)}
    assert len(other_pos) > 1  # the position changes the noise


def test_sampling_follows_the_distribution():
    lg = torch.tensor([[0.0, 1.0, 2.0]])
    s = Sampler()
    counts = torch.zeros(3)
    for seed in range(3000):
        counts[s(lg.clone(), [row(seed=seed, temperature=1.0)])[0]] += 1
    expected = lg[0].softmax(-1) * 3000
    assert torch.all((counts - expected).abs() < 0.1 * 3000)


def test_penalties():
    lg = torch.zeros(1, V)
    lg[0, 3] = 2.0
    lg[0, 4] = 1.9
    s = Sampler()
    assert s(lg.clone(), [row(temperature=0)]) == [3]
    assert s(lg.clone(), [row(temperature=0, output=[3], presence_penalty=0.5)]) == [4]
    assert s(lg.clone(), [row(temperature=0, output=[3, 3], frequency_penalty=0.1)]) == [4]
    assert s(lg.clone(), [row(temperature=0, prompt=[3], repetition_penalty=1.2)]) == [4]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(top_k=-2),
        dict(min_p=2.0),
        dict(repetition_penalty=0),
        dict(n=2),
    ],
)
def test_invalid_params_name_the_parameter(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)

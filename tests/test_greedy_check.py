"""``assert_same_or_near_tie``: two engines' greedy tokens may part only at a near-tie of the
reference's logits. A stand-in reference with chosen logits makes both outcomes happen."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.testing.greedy_check import assert_same_or_near_tie


def reference(gap: float):
    """Logits over 4 tokens at every position: token 1 best, token 2 ``gap`` below it."""

    def forward(ids: torch.Tensor):
        logits = torch.zeros(ids.shape[0], ids.shape[1], 4)
        logits[..., 1] = 5.0
        logits[..., 2] = 5.0 - gap
        return SimpleNamespace(logits=logits)

    return forward


def test_identical_lists_pass_without_asking_the_reference():
    assert_same_or_near_tie([[1, 2, 3]], [[1, 2, 3]], [[0]], hf=None)


def test_a_split_at_a_near_tie_passes_and_one_at_a_clear_choice_fails():
    got, want = [[1, 1, 2]], [[1, 1, 1]]
    assert_same_or_near_tie(got, want, [[0, 3]], reference(5e-5))
    with pytest.raises(AssertionError, match="differs at token 2: 2 vs 1"):
        assert_same_or_near_tie(got, want, [[0, 3]], reference(0.5))


def test_different_lengths_fail():
    with pytest.raises(AssertionError, match="2 tokens vs the reference's 3"):
        assert_same_or_near_tie([[1, 2]], [[1, 1, 1]], [[0]], reference(0.0))

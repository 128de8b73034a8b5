"""The n-gram drafter's incremental suffix index against the definition of prompt lookup."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_core.builtin.drafters import NgramDrafter


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    """The longest suffix (max_n .. min_n tokens) occurring earlier with a token after it: the
    tokens after its latest such occurrence (a scan of every earlier window)."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        starts = [s for s in range(0, L - n) if tokens[s : s + n] == suffix]
        if starts:
            return n, tokens[starts[-1] + n : starts[-1] + n + k]
    return 0, []


@pytest.mark.parametrize("vocab, min_n, max_n", [(3, 1, 4), (6, 2, 3), (50, 1, 5)])
def test_matches_equal_the_scan_as_a_history_grows(vocab, min_n, max_n):
    rng = np.random.default_rng(vocab * 10 + max_n)
    drafter = NgramDrafter(min_n, max_n, gamma=4)
    for req in range(6):
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 5))).tolist()
        while len(tokens) < 120:
            assert drafter._match(str(req), tokens, 4) == brute_force(tokens, min_n, max_n, 4), tokens
            tokens += rng.integers(0, vocab, size=int(rng.integers(1, 7))).tolist()  # accepted drafts + 1
        drafter.release(str(req))
        assert str(req) not in drafter._index


def test_a_reused_request_id_with_a_shorter_history_is_indexed_afresh():
    drafter = NgramDrafter(1, 3, gamma=2)
    assert drafter._match("a", [1, 2, 3, 1, 2], 2) == (2, [3, 1])
    assert drafter._match("a", [7, 8, 7], 2) == brute_force([7, 8, 7], 1, 3, 2) == (1, [8, 7])

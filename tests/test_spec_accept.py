"""The speculative acceptance rule reproduces the target's distribution (chi-squared, scipy).

Synthetic target p and drafter q over a small vocabulary; drafts are drawn from q, as a drafter
would; the tokens the rule emits must follow p at every position, whatever q is, and the first
draft must be accepted with probability sum_i min(p_i, q_i) (the known acceptance rate).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.speculative import rejection_sample

scipy_stats = pytest.importorskip("scipy.stats")

N = 40_000
V = 6


def _dist(gen, sharp=1.0):
    return torch.softmax(torch.randn(V, generator=gen, dtype=torch.float64) * sharp, 0).float()


@pytest.mark.parametrize("deterministic", [False, True], ids=["q-distribution", "q-one-hot"])
def test_emitted_tokens_follow_the_target(deterministic):
    gen = torch.Generator().manual_seed(7 if deterministic else 3)
    p1, p2, p3 = _dist(gen, 2.0), _dist(gen, 1.0), _dist(gen, 1.5)  # the target, per position
    q1, q2 = _dist(gen, 2.0), _dist(gen, 0.5)  # the drafter: different from p
    if deterministic:  # a drafter that always proposes its argmax (n-gram, greedy heads)
        d = torch.stack([q1.argmax().expand(N), q2.argmax().expand(N)], 1)
        q = None
    else:
        d = torch.stack(
            [torch.multinomial(q1, N, True, generator=gen), torch.multinomial(q2, N, True, generator=gen)], 1
        )
        q = torch.stack([q1, q2]).expand(N, 2, V)
    p = torch.stack([p1, p2, p3]).expand(N, 3, V)
    tokens, accepted = rejection_sample(p, d, q, generator=gen)
    assert tokens.shape == (N, 3) and accepted.shape == (N,)
    assert int(accepted.min()) >= 0 and int(accepted.max()) <= 2
    # the accepted prefix is the drafts
    for k in range(2):
        rows = accepted > k
        assert torch.equal(tokens[rows, k], d[rows, k])
    # position 1: every row emits one token there; position 2: rows that accepted draft 1
    for pos, target, rows in ((0, p1, torch.ones(N, dtype=torch.bool)), (1, p2, accepted >= 1), (2, p3, accepted >= 2)):
        got = torch.bincount(tokens[rows, pos], minlength=V).double()
        if got.sum() < 2000:
            continue
        expected = target.double() / target.double().sum() * got.sum()
        _, pvalue = scipy_stats.chisquare(got.numpy(), expected.numpy())
        assert pvalue > 1e-4, f"position {pos}: emitted {got.tolist()} vs expected {expected.tolist()}"
    # the first draft's acceptance rate is sum(min(p, q)) (one-hot q: p(d))
    q1_eff = torch.nn.functional.one_hot(q1.argmax(), V).float() if deterministic else q1
    rate = float(torch.minimum(p1, q1_eff).sum())
    n_acc = int((accepted >= 1).sum())
    assert scipy_stats.binomtest(n_acc, N, rate).pvalue > 1e-4


def test_the_rule_is_not_just_the_target():
    """The check above can fail: a rule that always keeps the drafts emits q, not p."""
    gen = torch.Generator().manual_seed(1)
    p1, q1 = _dist(gen, 2.0), _dist(gen, 2.0)
    drafts = torch.multinomial(q1, N, True, generator=gen)
    got = torch.bincount(drafts, minlength=V).double()
    _, pvalue = scipy_stats.chisquare(got.numpy(), (p1.double() / p1.double().sum() * N).numpy())
    assert pvalue < 1e-6


def test_equal_distributions_accept_everything():
    gen = torch.Generator().manual_seed(2)
    p = _dist(gen).expand(500, 2, V)
    d = torch.multinomial(p[0, 0], 500, True, generator=gen)[:, None]
    tokens, accepted = rejection_sample(p, d, p[:, :1], generator=gen)
    assert int(accepted.sum()) == 500
    assert torch.equal(tokens[:, 0], d[:, 0])

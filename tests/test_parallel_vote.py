"""The per-step group vote across 2 real gloo ranks: "any triggers" flags by MAX, "all must agree"
flags by MIN, and the second round that can still turn graphs off; every rank gets the same
decision, equal to the rule applied by hand to both ranks' votes."""

from __future__ import annotations

import queue
import traceback

from deepinfer_core.engine.parallel.launch import RankEnv, free_port, init_process_group, rank_context, start_ranks
from deepinfer_core.engine.parallel.lockstep import StepVote, vote

# (rank 0's vote, its graph_ready), (rank 1's vote, its graph_ready)
CASES = [
    ((StepVote(5, True, False, 1), True), (StepVote(0, False, True, 0), True)),  # one prefills, one idle
    ((StepVote(3, False, True, 1), True), (StepVote(1, False, True, 1), True)),  # both decode, graphs agreed
    ((StepVote(3, False, True, 1), True), (StepVote(1, False, True, 1), False)),  # rank 1 cannot replay one
    ((StepVote(2, False, True, 2, stop=False, rebalance=True), True), (StepVote(0, False, False, 0, stop=True), True)),
]


def _rank(rank: int, port: int, results) -> None:
    import torch

    try:
        init_process_group(RankEnv(rank, 2, master_port=port), "cpu", timeout_s=30)
        got = []
        for case in CASES:
            mine, ready = case[rank]
            got.append(vote(mine, torch.device("cpu"), graph_ready=lambda ready=ready: ready))
        results.put((rank, got))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def expected(a: tuple[StepVote, bool], b: tuple[StepVote, bool]) -> tuple:
    (va, ra), (vb, rb) = a, b
    prefill = va.is_prefill or vb.is_prefill
    graph = va.can_use_graph and vb.can_use_graph and not prefill and ra and rb
    return (max(va.tokens, vb.tokens), prefill, graph, max(va.passes, vb.passes), va.stop or vb.stop,
            va.rebalance or vb.rebalance)  # fmt: skip


def test_every_rank_gets_the_same_decision_by_the_voting_rules():
    results = rank_context().Queue()
    ranks = start_ranks(_rank, 2, (free_port(), results))
    try:
        got = dict(results.get(timeout=120) for _ in range(2))
    except queue.Empty:
        raise AssertionError("the ranks did not answer") from None
    finally:
        ranks.join(timeout=30)
    for rank, decisions in got.items():
        assert not isinstance(decisions, str), decisions
        for case, d in zip(CASES, decisions):
            have = (d.max_tokens, d.any_prefill, d.use_graph, d.passes, d.stop, d.rebalance)
            assert have == expected(*case), f"rank {rank}, votes {case}"

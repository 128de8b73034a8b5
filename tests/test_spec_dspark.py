"""DSpark (confidence-scheduled verification): the plan verifies the global top-K survivals,
never more than the budget, without reading the device; K is the argmax of the throughput model
(checked against brute force); with the engine, the output is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core import LLM
from deepinfer_core.engine.sampling_params import SamplingParams
from deepinfer_core.engine.spec_decode import StepRate, choose_budget
from deepinfer_core.speculative import ConfidenceScheduledVerification


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 6),
    st.integers(0, 40),
    st.integers(0, 2**31 - 1),
)
def test_plan_is_the_global_top_k_of_survivals(num_reqs, gamma, budget, seed):
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(num_reqs, gamma, generator=g, dtype=torch.float64).float()
    plan = ConfidenceScheduledVerification().plan(conf, budget)
    assert plan.dtype == torch.int64 and plan.shape == (num_reqs,)
    assert int(plan.min()) >= 0 and int(plan.max()) <= gamma
    k = min(budget, num_reqs * gamma)
    assert int(plan.sum()) == k  # never more than the budget, and all of it when drafts remain
    surv = [[float(np.prod(conf[r, : j + 1].double().numpy())) for j in range(gamma)] for r in range(num_reqs)]
    chosen = sorted((surv[r][j] for r in range(num_reqs) for j in range(int(plan[r]))), reverse=True)
    best = sorted((x for row in surv for x in row), reverse=True)[:k]
    assert chosen == pytest.approx(best, rel=1e-6)


def _brute_k(surv, num_reqs, budget, rate):
    top = sorted(surv, reverse=True)
    values = [(num_reqs + sum(top[:k])) * float(rate(np.array([num_reqs + k]))[0]) for k in range(budget + 1)]
    return int(np.argmax(values))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.integers(0, 200), st.integers(0, 2**31 - 1), st.floats(0.0, 0.05))
def test_k_maximises_the_throughput_model(num_reqs, budget, seed, slope):
    rng = np.random.default_rng(seed)
    surv = np.cumprod(rng.random((num_reqs, 5)), axis=1).ravel()
    curve = [(1, 100.0), (64, 100.0 / (1 + 63 * slope)), (512, 100.0 / (1 + 511 * slope))]
    rate = StepRate(curve)
    k = choose_budget(surv, num_reqs, budget, rate)
    assert 0 <= k <= min(budget, surv.size)
    assert k == _brute_k(list(surv), num_reqs, min(budget, surv.size), rate)


def test_k_is_zero_when_verifying_costs_more_than_it_gains():
    rate = StepRate([(1, 100.0), (8, 100.0), (9, 10.0), (512, 1.0)])  # a cliff past 8 tokens
    assert choose_budget(np.full(40, 0.05), 8, 40, rate) == 0
    flat = StepRate([(1, 100.0), (512, 100.0)])
    assert choose_budget(np.full(40, 0.05), 8, 30, flat) == 30  # free verification: take it all


@pytest.mark.usefixtures("one_thread")
def test_engine_with_confidence_verification_matches_decoding(tiny_llama):
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 10, list(range(20, 50))]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 3
    base = LLM(tiny_llama, device="cpu", dtype="float32", block_size=16, kv_cache_blocks=32)
    expected = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in prompts], params)]
    for curve in (None, [[1, 100.0], [4, 100.0], [5, 20.0], [64, 5.0]]):
        spec = {"method": "ngram", "num_speculative_tokens": 4, "verification": "confidence"}
        if curve is not None:
            spec["steps_per_second"] = curve
        llm = LLM(tiny_llama, device="cpu", dtype="float32", block_size=16, kv_cache_blocks=32,
                  max_num_batched_tokens=64, speculative_config=spec)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = llm.engine.stats()["spec_decode"]
        assert stats["last_budget"] is not None and stats["last_budget"] <= 64 - 1
        if curve is not None:  # verifying past 1 extra token per request costs 5x: K stays small
            assert stats["num_draft_tokens"] <= stats["num_drafts"] * 2

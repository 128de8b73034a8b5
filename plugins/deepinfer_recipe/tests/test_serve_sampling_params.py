"""Sampling parameters the APIs accept are applied, or refused in the protocol's error shape
(issue 31.4: Chat Completions took any value of ``top_k``, ``min_p``, ``repetition_penalty``
and ``logit_bias``, even ``"x"``, and ignored them).

Clients: the real ``openai`` SDK (the extensions go in ``extra_body``, as with vLLM). Each check
would fail if the parameter were ignored: a +100 bias forces its token; ``top_k=1`` and
``min_p=1`` make sampling at temperature 1 greedy; the answer under a -100 bias on the greedy
token, and under a repetition penalty, is the one computed from the model's own logits (an
in-process engine recording its logits, no server and no protocol code involved).
"""

from __future__ import annotations

import openai
import pytest
import torch
from serve_harness import ENGINE_ARGS, MODEL

PROMPT = "The capital of France is the city of"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def reference():
    """SmolLM2 in this process: ``logits(ids)`` is the model's next-token row for a prompt."""
    from deepinfer_core import LLM, SamplingParams

    llm = LLM(MODEL, **ENGINE_ARGS)

    def logits(ids: list[int]) -> torch.Tensor:
        rows = []
        record = lambda out, row: rows.append(row.clone()) or row  # noqa: E731
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logits_processors=[record]))
        return rows[0]

    llm.logits = logits
    return llm


def test_logit_bias_minus_100_on_the_greedy_token_gives_the_second_best(oai, reference):
    ids = reference.get_tokenizer().encode(PROMPT, add_special_tokens=True)
    row = reference.logits(ids)
    best, second = torch.topk(row, 2).indices.tolist()
    reply = oai.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert reference.get_tokenizer().decode([best]) == reply.choices[0].text
    biased = oai.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logit_bias={str(best): -100}
    ).choices[0]
    assert biased.text == reference.get_tokenizer().decode([second])


def test_chat_logit_bias_forces_a_token_and_bad_values_are_refused(oai, reference):
    tok = reference.get_tokenizer()
    forced = tok.encode(" zebra", add_special_tokens=False)[0]
    reply = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=1, temperature=0, logit_bias={str(forced): 100}
    )
    assert reply.choices[0].message.content == tok.decode([forced])
    for bad, param in [
        ("x", "logit_bias"),
        ({"12": "x"}, "logit_bias['12']"),
        ({"12": 101}, "logit_bias['12']"),
        ({"abc": 1}, "logit_bias['abc']"),
        ({"99999999": 1}, "logit_bias"),  # outside the vocabulary
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"logit_bias": bad})
        assert info.value.param == param, (bad, info.value.param, info.value.message)


def test_top_k_1_and_min_p_1_make_temperature_1_sampling_greedy(oai):
    greedy = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    expected = greedy.choices[0].message.content
    free = []
    for seed in range(3):
        kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=seed)
        for extension in ({"top_k": 1}, {"min_p": 1.0}):
            got = oai.chat.completions.create(**kw, extra_body=extension).choices[0].message.content
            assert got == expected, (extension, seed)
        free.append(oai.chat.completions.create(**kw).choices[0].message.content)
    assert free != [expected] * 3  # at temperature 1 without the filter, some sample differs


def test_repetition_penalty_is_applied_as_the_model_logits_say(oai, reference):
    """Greedy decoding under a penalty, step by step from the model's own rows: each token is
    the argmax after dividing (positive) or multiplying (negative) the logits of every token
    already in the prompt or the output, the rule the parameter names."""
    tok = reference.get_tokenizer()
    ids = tok.encode("one two one two one two one", add_special_tokens=True)
    penalty, out = 1.8, []
    for _ in range(4):
        row = torch.from_numpy(reference.logits(ids + out).numpy().copy())
        seen = torch.tensor(sorted(set(ids + out)))
        row[seen] = torch.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        out.append(int(row.argmax()))
    plain = oai.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0).choices[0].text
    reply = oai.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, temperature=0, extra_body={"repetition_penalty": penalty}
    )
    assert reply.choices[0].text == tok.decode(out) != plain
    chat = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, extra_body={"repetition_penalty": penalty}
    )
    assert chat.choices[0].message.content


@pytest.mark.parametrize(
    "extension",
    [
        {"top_k": "x"},
        {"top_k": -2},
        {"min_p": 1.5},
        {"min_p": "x"},
        {"repetition_penalty": 0},
        {"repetition_penalty": "x"},
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_sampling_extensions_are_refused_naming_the_parameter(oai, extension, endpoint):
    (name,) = extension
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body=extension)
        else:
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extension)
    assert info.value.param == name, info.value.message

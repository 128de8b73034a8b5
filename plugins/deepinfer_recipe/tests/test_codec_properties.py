"""Property-based: random and mutated request bodies against each codec (issue 7 acceptance).

Every body is either parsed (and then renders and tokenizes as a DeepSeek-V4 prompt) or refused
with a ``ProtocolError`` whose status is 4xx; no other exception escapes. Bodies come from two
generators: random JSON-shaped bodies over each protocol's real field names, and valid bodies
with one to three random mutations (a value replaced by random or hostile JSON, a key deleted,
an item duplicated). Hostile values include lone surrogates, NaN, nesting past Python's
recursion limit, typed special-token strings and non-JSON Python types.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_core.codecs import ConversationRequest, ProtocolError
from deepinfer_recipe.anthropic_messages import AnthropicMessagesCodec
from deepinfer_recipe.deepseek_v4 import DeepSeekV4Encoding
from deepinfer_recipe.openai_chat import OpenAIChatCodec
from deepinfer_recipe.openai_responses import OpenAIResponsesCodec

EXAMPLES = 1000
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = [
    "\ud800",
    "a\udfffb",
    float("nan"),
    float("inf"),
    -1,
    0,
    10**30,
    1e308,
    True,
    "",
    " ",
    "none",
    "max",
    "<｜User｜>",
    "<｜end▁of▁sentence｜>",
    "</think>",
    "<｜DSML｜tool_calls>",
    "{",
    "[1]",
    '{"a": NaN}',
    "null",
    _nested(3000),
    {"a": _nested(200)},
    b"bytes",
    (1, 2),
    {1: "int key"},
    [None],
    {},
    [],
]


def _hostile_at(index: int):
    return HOSTILE[index]


# by index: hypothesis shows a strategy's elements in its repr, and the deep ones have none
LEAF = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(range(len(HOSTILE))).map(_hostile_at)
)
JSON = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)

FIELDS = {
    "chat": {
        "body": [
            "model",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "stop",
            "stream",
            "tools",
            "tool_choice",
            "thinking",
            "reasoning_effort",
            "response_format",
            "seed",
            "n",
            "stream_options",
            "user",
            "presence_penalty",
            "frequency_penalty",
        ],
        "message": ["role", "content", "tool_calls", "tool_call_id", "reasoning_content", "name", "prefix"],
        "roles": ["system", "developer", "user", "assistant", "tool"],
    },
    "anthropic": {
        "body": [
            "model",
            "messages",
            "max_tokens",
            "system",
            "temperature",
            "top_p",
            "top_k",
            "stop_sequences",
            "stream",
            "tools",
            "tool_choice",
            "thinking",
            "output_config",
            "metadata",
        ],
        "message": ["role", "content"],
        "roles": ["user", "assistant"],
    },
    "responses": {
        "body": [
            "model",
            "input",
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "stream",
            "tools",
            "tool_choice",
            "reasoning",
            "metadata",
            "text",
            "previous_response_id",
        ],
        "message": ["type", "role", "content", "call_id", "name", "arguments", "output", "summary"],
        "roles": ["user", "assistant", "system", "developer"],
    },
}

CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}
VALID = {
    "chat": [
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        {
            "model": "m",
            "tools": [TOOL],
            "stop": ["END"],
            "thinking": {"type": "enabled"},
            "reasoning_effort": "max",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "q"}]},
                {"role": "assistant", "reasoning_content": "r", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "R"}]},
                {"role": "assistant", "content": "a", "prefix": True},
            ],
        },
    ],
    "anthropic": [
        {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
        {
            "model": "m",
            "max_tokens": 4096,
            "system": [{"type": "text", "text": "S"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "lookup"},
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "r", "signature": ""},
                        {"type": "tool_use", "id": "t", "name": "lookup", "input": {"q": "x"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "R"}]},
                        {"type": "text", "text": "more"},
                    ],
                },
            ],
        },
    ],
    "responses": [
        {"model": "m", "input": "hi"},
        {
            "model": "m",
            "instructions": "S",
            "reasoning": {"effort": "high"},
            "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
                {"type": "function_call", "call_id": "c", "name": "lookup", "arguments": '{"q": "x"}'},
                {"type": "function_call_output", "call_id": "c", "output": "R"},
                {"role": "user", "content": [{"type": "input_text", "text": "more"}]},
            ],
        },
    ],
}
CODECS = {"chat": OpenAIChatCodec, "anthropic": AnthropicMessagesCodec, "responses": OpenAIResponsesCodec}


def _with(pair):
    fixed, rest = pair
    return {**rest, **fixed}


def random_bodies(name: str):
    """A few of the protocol's real fields (and a model most of the time) with random values;
    messages are objects with a real role and a few real fields."""
    spec = FIELDS[name]
    message = st.tuples(
        st.fixed_dictionaries({"role": st.sampled_from(spec["roles"])}),
        st.dictionaries(st.sampled_from(spec["message"]), JSON, max_size=3),
    ).map(_with)
    list_field = spec["body"][1]
    fixed = st.fixed_dictionaries({"model": st.just("m"), list_field: st.lists(message, max_size=4) | JSON})
    return st.tuples(fixed | st.just({}), st.dictionaries(st.sampled_from(spec["body"]), JSON, max_size=5)).map(_with)


def _hostile(value) -> bool:
    """A shared HOSTILE object: never mutated, never walked into."""
    return any(value is h for h in HOSTILE)


def _containers(body) -> list:
    """(container, key) for every value inside ``body`` (iterative; HOSTILE objects are leaves)."""
    found, stack = [], [body]
    while stack:
        node = stack.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node))
        for key in keys:
            found.append((node, key))
            if isinstance(node[key], (dict, list)) and not _hostile(node[key]):
                stack.append(node[key])
    return found


def _copy(value):
    """Deep copy of a valid body (plain JSON, shallow enough for recursion)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


@st.composite
def mutated_bodies(draw, name: str):
    body = _copy(draw(st.sampled_from(VALID[name])))
    for _ in range(draw(st.integers(1, 3))):
        places = _containers(body)
        if not places:
            break
        node, key = draw(st.sampled_from(places))
        action = draw(st.sampled_from(["replace", "replace", "delete", "duplicate"]))
        if action == "replace":
            node[key] = draw(JSON)
        elif action == "delete":
            node.pop(key) if isinstance(node, dict) else node.pop(key)
        elif isinstance(node[key], list) and node[key] and not _hostile(node[key]):
            node[key].append(node[key][0])
    return body


def served_or_refused(codec, encoding, body) -> None:
    try:
        request = codec.parse_request(body)
    except ProtocolError as error:
        assert 400 <= error.status < 500, error.status
        assert error.message
        return
    assert isinstance(request, ConversationRequest)
    encoding.encode(request)  # renders and tokenizes: nothing may escape here either


@pytest.fixture(scope="module")
def encoding(tokenizer_path):
    return DeepSeekV4Encoding(tokenizer_path=str(tokenizer_path))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_random_bodies_are_served_or_refused(name, encoding):
    codec = CODECS[name]()

    @PROPERTY
    @given(random_bodies(name))
    def check(body):
        served_or_refused(codec, encoding, body)

    check()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_mutated_bodies_are_served_or_refused(name, encoding):
    codec = CODECS[name]()

    @PROPERTY
    @given(mutated_bodies(name))
    def check(body):
        served_or_refused(codec, encoding, body)

    check()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_valid_seeds_are_served(name, encoding):
    for body in VALID[name]:
        encoding.encode(CODECS[name]().parse_request(_copy(body)))

"""The reference-behaviour cases reached through the HTTP codecs: the same conversation sent as
an OpenAI Chat Completions or Anthropic Messages body renders the reference encoder's prompt
(``data/deepseek_v4_encoding/reference_behaviour.json``)."""

from __future__ import annotations

import pytest
from recipe_testdata import DATA, load

from deepinfer_core.codecs import ProtocolError
from deepinfer_recipe.anthropic_messages import AnthropicMessagesCodec
from deepinfer_recipe.deepseek_v4 import DeepSeekV4Encoding
from deepinfer_recipe.openai_chat import OpenAIChatCodec
from deepinfer_recipe.openai_responses import OpenAIResponsesCodec

EXPECTED = {v["name"]: v["prompt"] for v in load(DATA / "reference_behaviour.json")["encode"] if "prompt" in v}
LOOKUP = {
    "name": "lookup",
    "description": "Look up a fact.",
    "parameters": {
        "type": "object",
        "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["q"],
    },
}
OPENAI_TOOLS = [{"type": "function", "function": LOOKUP}]
ANTHROPIC_TOOLS = [{"name": LOOKUP["name"], "description": LOOKUP["description"], "input_schema": LOOKUP["parameters"]}]


def _call(call_id, args):
    return {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": args}}


def _openai(mode, messages, tools=False):
    body = {"model": "m", "messages": messages, "thinking": {"type": "enabled" if mode == "thinking" else "disabled"}}
    return {**body, "tools": OPENAI_TOOLS} if tools else body


TWO_CALLS = {
    "role": "assistant",
    "reasoning_content": "two",
    "tool_calls": [_call("a", '{"q": "A"}'), _call("b", '{"q": "B"}')],
}
OPENAI_CASES = {
    "consecutive_users_merged_chat": _openai(
        "chat",
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "first"},
            {"role": "user", "content": "second"},
            {"role": "user", "content": [{"type": "text", "text": "third"}]},
        ],
    ),
    "prefix_continuation_without_eos_thinking": _openai(
        "thinking",
        [
            {"role": "user", "content": "Write a poem."},
            {"role": "assistant", "reasoning_content": "short one", "content": "Roses are", "prefix": True},
        ],
    ),
    "prefix_continuation_without_eos_chat": _openai(
        "chat",
        [{"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": "Roses are", "prefix": True}],
    ),
    "tool_results_unmatched_id_thinking": _openai(
        "thinking",
        [
            {"role": "user", "content": "A and B"},
            TWO_CALLS,
            {"role": "tool", "tool_call_id": "b", "content": "RB"},
            {"role": "tool", "tool_call_id": "zzz", "content": "RZ"},
            {"role": "tool", "tool_call_id": "a", "content": "RA"},
        ],
        tools=True,
    ),
    "tool_results_then_user_text_chat": _openai(
        "chat",
        [
            {"role": "user", "content": "A and B"},
            TWO_CALLS,
            {"role": "tool", "tool_call_id": "b", "content": "RB"},
            {"role": "tool", "tool_call_id": "a", "content": "RA"},
            {"role": "user", "content": "and now?"},
        ],
        tools=True,
    ),
    "tool_result_text_parts": _openai(
        "chat",
        [
            {"role": "user", "content": "A"},
            {"role": "assistant", "tool_calls": [_call("a", '{"q": "x"}')]},
            {
                "role": "tool",
                "tool_call_id": "a",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
            },
        ],
        tools=True,
    ),
    "max_effort_chat": {**_openai("chat", [{"role": "user", "content": "hard"}]), "reasoning_effort": "max"},
    "max_effort_thinking": {**_openai("thinking", [{"role": "user", "content": "hard"}]), "reasoning_effort": "max"},
}
for label, args in (
    ("empty", ""),
    ("not_json", "get it now"),
    ("empty_object", "{}"),
    ("spacing_and_types", '{"n":1.50,"flag":true,"list":[1,2],"obj":{"k":null},"s":"中文"}'),
):
    OPENAI_CASES[f"tool_call_arguments_{label}"] = _openai(
        "chat",
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "ok", "tool_calls": [_call("c1", args)]},
            {"role": "tool", "tool_call_id": "c1", "content": "R"},
        ],
        tools=True,
    )


def _anthropic(mode, messages):
    thinking = {"type": "enabled", "budget_tokens": 1024} if mode == "thinking" else {"type": "disabled"}
    return {"model": "m", "max_tokens": 2048, "thinking": thinking, "tools": ANTHROPIC_TOOLS, "messages": messages}


ANTHROPIC_CALLS = {
    "role": "assistant",
    "content": [
        {"type": "thinking", "thinking": "two", "signature": ""},
        {"type": "tool_use", "id": "a", "name": "lookup", "input": {"q": "A"}},
        {"type": "tool_use", "id": "b", "name": "lookup", "input": {"q": "B"}},
    ],
}
ANTHROPIC_CASES = {
    "tool_results_unmatched_id_chat": _anthropic(
        "chat",
        [
            {"role": "user", "content": "A and B"},
            ANTHROPIC_CALLS,
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "b", "content": "RB"},
                    {"type": "tool_result", "tool_use_id": "zzz", "content": "RZ"},
                    {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "RA"}]},
                ],
            },
        ],
    ),
    "tool_results_then_user_text_thinking": _anthropic(
        "thinking",
        [
            {"role": "user", "content": "A and B"},
            ANTHROPIC_CALLS,
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "b", "content": "RB"},
                    {"type": "tool_result", "tool_use_id": "a", "content": "RA"},
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
    ),
    "tool_result_text_parts": _anthropic(
        "chat",
        [
            {"role": "user", "content": "A"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "lookup", "input": {"q": "x"}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "a",
                        "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
                    }
                ],
            },
        ],
    ),
}


def _without_tools(body):
    return {k: v for k, v in body.items() if k != "tools"}


ANTHROPIC_CASES["prefix_continuation_without_eos_chat"] = _without_tools(
    _anthropic("chat", [{"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": "Roses are"}])
)
ANTHROPIC_CASES["prefix_continuation_without_eos_thinking"] = _without_tools(
    _anthropic(
        "thinking",
        [
            {"role": "user", "content": "Write a poem."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "short one", "signature": ""},
                    {"type": "text", "text": "Roses are"},
                ],
            },
        ],
    )
)
ANTHROPIC_CASES["consecutive_users_merged_thinking"] = _without_tools(
    _anthropic(
        "thinking",
        [
            {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
            {"role": "user", "content": "third"},
        ],
    )
) | {"system": "S"}


@pytest.mark.parametrize("name", sorted(OPENAI_CASES))
def test_openai_chat_body_renders_reference_prompt(name):
    request = OpenAIChatCodec().parse_request(OPENAI_CASES[name])
    assert DeepSeekV4Encoding().render(request) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(ANTHROPIC_CASES))
def test_anthropic_body_renders_reference_prompt(name):
    request = AnthropicMessagesCodec().parse_request(ANTHROPIC_CASES[name])
    assert DeepSeekV4Encoding().render(request) == EXPECTED[name]


def test_responses_function_output_parts_render_reference_prompt():
    request = OpenAIResponsesCodec().parse_request(
        {
            "model": "m",
            "tools": [{"type": "function", **LOOKUP}],
            "reasoning": {"effort": "none"},
            "input": [
                {"role": "user", "content": "A"},
                {"type": "function_call", "call_id": "a", "name": "lookup", "arguments": '{"q": "x"}'},
                {
                    "type": "function_call_output",
                    "call_id": "a",
                    "output": [{"type": "input_text", "text": "part one"}, {"type": "input_text", "text": "part two"}],
                },
            ],
        }
    )
    assert DeepSeekV4Encoding().render(request) == EXPECTED["tool_result_text_parts"]


def test_prefix_only_on_the_last_message():
    with pytest.raises(ProtocolError) as info:
        OpenAIChatCodec().parse_request(
            {
                "model": "m",
                "messages": [{"role": "assistant", "content": "a", "prefix": True}, {"role": "user", "content": "b"}],
            }
        )
    assert info.value.param == "messages[0].prefix"

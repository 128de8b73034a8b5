"""A small fast case of ``benchmarks/cpu/cpu_gguf_check.py``: the CPU default on GGUF files nobody
tuned for (random weights, shapes and tensor types other than SmolLM2's).

The reference is the same file loaded with ``dtype="float32"``: the ``gguf`` library dequantizes
every tensor (its own reader, not our packing code) and the float32 model is pinned to
transformers elsewhere. Random weights are chaotic, so tokens are checked teacher-forced
(``testing.greedy_check``): each the reference's argmax or within 0.3 of it.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.lowbit import describe_weights, native
from deepinfer_core.testing.gguf_files import write_random_llama_gguf
from deepinfer_core.testing.greedy_check import check_greedy

pytest.importorskip("gguf")
pytestmark = [
    pytest.mark.skipif(native.load().lib is None, reason=f"low-bit kernels unavailable here: {native.load().reason}"),
    pytest.mark.usefixtures("one_thread"),
]
SMALL = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=1, vocab=997, tied=False)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, size=n).tolist() for n in (1, 9, 63, 130, 5)]


def _greedy(llm, prompts, n=8):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    "name, shape, types, kinds",
    [
        # K-quants with a Q6_K head (the gguf library has no K-quant quantizer: random blocks)
        (
            "q4_k",
            {},
            {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"},
            "low-bit: 4 q4<Q4_K>, 3 q8<Q6_K>",
        ),
        # Q5_0 and Q5_1 in one fused projection, head_dim 80, one KV head, a tied Q8_0 head, width 640
        (
            "q5_mix",
            dict(hidden=640, heads=8, kv_heads=1, head_dim=80, intermediate=1728, tied=True),
            {"*": "Q5_0", "attn_v": "Q5_1", "token_embd": "Q8_0"},
            "low-bit: 1 q5<Q5_0+Q5_1>, 3 q5<Q5_0>, 1 q8<Q8_0>",
        ),
        # a type kept by re-quantizing to q8 (gguf dequantizes it)
        ("iq2_xxs", {}, {"*": "IQ2_XXS", "output": "Q8_0"}, "low-bit: 5 q8<IQ2_XXS>, 1 q8<Q8_0>"),
    ],
)
def test_untuned_file_runs_packed_on_the_native_plan_and_follows_the_float32_model(tmp_path, name, shape, types, kinds):
    cfg = {**SMALL, **shape}
    path = write_random_llama_gguf(tmp_path / f"{name}.gguf", types=types, **cfg)
    llm = LLM(path, device="cpu", kv_cache_blocks=16, max_num_seqs=8, enable_prefix_caching=False)
    got_kinds = describe_weights(llm.engine.model)
    prompts = _prompts(cfg["vocab"])
    out = _greedy(llm, prompts)
    assert got_kinds == kinds  # which kind each tensor became (a fused projection of two kinds: two segments)
    assert llm.engine.model.fused_step is not None  # the one-call native decode step, not the torch path
    ref = LLM(
        path, device="cpu", dtype="float32", kv_cache_blocks=4, max_num_seqs=1, enable_prefix_caching=False
    ).engine
    report = check_greedy(ref, prompts, out, tolerance=0.3)
    assert not report.misses and report.tokens == 40, report
    # batch invariance: prompt 3 alone gives what it gave among the five
    assert _greedy(llm, [prompts[3]]) == [out[3]]


def test_a_type_nothing_can_read_is_refused_naming_it(tmp_path):
    path = write_random_llama_gguf(tmp_path / "q1.gguf", types={"*": "Q8_0", "ffn_up": "Q1_0"}, **SMALL)
    with pytest.raises(NotImplementedError, match=r"tensor blk\.0\.ffn_up\.weight is Q1_0"):
        LLM(path, device="cpu", kv_cache_blocks=4)


def test_a_dense_layer_in_a_quantized_file_says_the_native_plan_is_off(tmp_path, caplog):
    """An intermediate size of 1000 (not a multiple of 32) leaves down_proj F16, so dense: the
    engine still answers like the float32 model, and says why decode steps are slower."""
    path = write_random_llama_gguf(
        tmp_path / "f16down.gguf", types={"*": "Q4_0", "ffn_down": "F16"}, **{**SMALL, "intermediate": 1000}
    )
    with caplog.at_level(logging.WARNING, logger="deepinfer_core.builtin.lowbit.llama_decode"):
        llm = LLM(path, device="cpu", kv_cache_blocks=4, max_num_seqs=8, enable_prefix_caching=False)
        prompts = _prompts(SMALL["vocab"])
        out = _greedy(llm, prompts)
    assert llm.engine.model.fused_step is None
    assert "layer 0's down_proj (Linear in_features=1000" in caplog.text
    ref = LLM(
        path, device="cpu", dtype="float32", kv_cache_blocks=4, max_num_seqs=1, enable_prefix_caching=False
    ).engine
    assert not check_greedy(ref, prompts, out, tolerance=0.3).misses

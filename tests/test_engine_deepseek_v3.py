"""DeepSeek-V3 (MLA + DeepSeekMoE) through the public offline API, against transformers.

A tiny random ``DeepseekV3Config`` (2 dense + 2 MoE layers, group-limited routing, a shared
expert) is saved with ``save_pretrained``; ``LLM(path)`` must reproduce transformers' greedy
tokens and logits for prompts of different lengths batched together.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from deepinfer_core.testing.v3_checkpoint import tiny_deepseek_v3  # noqa: E402

PROMPT_LENS = [2, 5, 9, 17, 33, 60, 130, 200]
NEW = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3")
    model = tiny_deepseek_v3(
        path, seed=1234, router_gain=6.0,  # routing decisive and varied
        vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
        n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.0, max_position_embeddings=512, initializer_range=0.08,
    )  # fmt: skip
    model.generation_config.eos_token_id = None  # compare full-length continuations
    return path, model


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_greedy_tokens_match_transformers(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=24)
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for p, out in zip(prompts(), outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW,
                do_sample=False,
            )
        assert out.outputs[0].token_ids == ref[0, len(p) :].tolist(), f"prompt of {len(p)} tokens"


def test_logits_match_transformers_in_one_flat_batch(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=24)
    runner = llm.engine.runner
    ps = prompts()
    # every prompt in one step, each in its own (non-contiguous, reversed) blocks
    sched = SchedulerOutput(
        tuple(ScheduledRequest(str(i), tuple(p), 0, (23 - 2 * i, 22 - 2 * i), True, 0) for i, p in enumerate(ps)),
        sum(map(len, ps)),
    )
    input_ids, meta, _ = runner.build_batch(sched)
    with torch.inference_mode():
        hidden = runner.model.forward(input_ids, meta.positions, runner.kv_caches, meta)
        ours = runner.model.compute_logits(hidden)
        start = 0
        for p in ps:
            ref = hf(torch.tensor([p])).logits[0].float()
            assert (ours[start : start + len(p)] - ref).abs().max().item() < 1e-4
            assert (llm.engine.prompt_logits(p) - ref).abs().max().item() < 1e-4
            start += len(p)


def test_prefix_cache_and_preemption_keep_outputs(checkpoint):
    path, _ = checkpoint
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    big = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=24)
    reference = big.generate(prompts(), params)
    again = big.generate(prompts(), params)
    assert [o.num_cached_tokens for o in again] == [(n - 1) // 128 * 128 for n in PROMPT_LENS]
    for a, b in zip(reference, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids

    # Three 120-token prompts start in one block each and all need a second one at token 128:
    # a 4-block pool cannot hold them together, so the newest is preempted and recomputed.
    g = torch.Generator().manual_seed(3)
    crowd = [torch.randint(2, 384, (120,), generator=g).tolist() for _ in range(3)]
    long_params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    expected = big.generate(crowd, long_params)
    small = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=4)
    squeezed = small.generate(crowd, long_params)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(expected, squeezed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids

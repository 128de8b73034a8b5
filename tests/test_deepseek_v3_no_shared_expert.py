"""A DeepSeek-V3 checkpoint with ``n_shared_experts: 0``: transformers still writes each MoE
layer's shared expert, zero channels wide (empty tensors); the loader skips them (it refused the
file as "unexpected tensors") and the model, with no shared expert, gives transformers' float32
logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from deepinfer_core import LLM  # noqa: E402
from deepinfer_core.testing.v3_checkpoint import tiny_deepseek_v3  # noqa: E402


def test_no_shared_expert_matches_transformers(tmp_path):
    hf = tiny_deepseek_v3(
        tmp_path, seed=0,
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=0, max_position_embeddings=1024, initializer_range=0.1,
    )  # fmt: skip
    assert hf.model.layers[1].mlp.shared_experts.down_proj.weight.numel() == 0  # what the file holds
    prompt = list(range(2, 150))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8)
    assert llm.engine.model.model.layers[1].mlp.shared_experts is None
    got = llm.engine.prompt_logits(prompt)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()

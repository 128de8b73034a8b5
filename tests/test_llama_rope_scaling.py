"""Llama checkpoints with "linear" and "yarn" rope scaling (rope_inv_freq) against transformers'
float32 logits, over prompts past the original context so the scaled frequencies matter; and
"dynamic" (frequencies that change with the sequence length) still refused at load."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deepinfer_core import LLM  # noqa: E402

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-attention-factor-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                    "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2},
}  # fmt: skip


def checkpoint(path, rope_scaling):
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024, rope_theta=10000.0, rope_scaling=rope_scaling,
                                   initializer_range=0.2, bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_rope_matches_transformers(tmp_path, name):
    hf = checkpoint(tmp_path, SCALINGS[name])
    prompt = torch.randint(2, 211, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8, block_size=64)
    got = llm.engine.prompt_logits(prompt)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    # the scaling is not a no-op here: the unscaled model's logits are far from these
    plain = checkpoint(tmp_path / "plain", None)
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert (plain(torch.tensor([prompt])).logits[0] - want).abs().max() > 1e-2 * want.abs().max()


def test_dynamic_rope_is_refused(tmp_path):
    checkpoint(tmp_path, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_mlp_bias_matches_transformers(tmp_path, dtype):
    """``mlp_bias: true`` (gate / up / down biases) was refused at load as unexpected tensors;
    the biases now load and count, on the default CPU path (``auto``) as in float32."""
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   mlp_bias=True, attention_bias=True, initializer_range=0.2, bos_token_id=0,
                                   eos_token_id=1)  # fmt: skip
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path)
    prompt = list(range(2, 120))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    llm = LLM(str(tmp_path), device="cpu", dtype=dtype, kv_cache_blocks=8, block_size=64)
    got = llm.engine.prompt_logits(prompt)
    tol = 1e-4 if dtype == "float32" else 5e-2  # dropping the MLP biases moves these logits by ~75%
    assert (got - want).abs().max() < tol * want.abs().max()
    if dtype == "float32":  # decode steps too: transformers' greedy continuation
        from deepinfer_core import SamplingParams
        from deepinfer_core.testing.greedy_check import assert_same_or_near_tie

        ours = [
            list(
                llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
                .outputs[0]
                .token_ids
            )
        ]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        assert_same_or_near_tie(ours, [theirs], [prompt], hf)

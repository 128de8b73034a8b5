"""DeepSeek-V4 exactness over many tiny configs: layer-kind mixes, windows, compress rates, hash
layers, stream counts, odd head counts, rope variants, top-k edge cases; prompts longer than
several compression windows; chunk budgets that are not multiples of the rates. Each config:
logits at every prompt position within 1e-4 of transformers, greedy tokens under chunked
prefill equal to transformers' ``generate``, and the same tokens again on prefix-cache hits.

CI runs ``CI_CONFIGS``; ``DEEPINFER_V4_SWEEP=1`` runs every config in ``CONFIGS`` (minutes).
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.fail("transformers >= 5.24 (DeepseekV4) is required for the DeepSeek-V4 tests")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.testing.v4_tiny import randomise_zero_initialised  # noqa: E402

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
VOCAB = 256

# name -> (config overrides, prompt lengths, chunk budget)
CONFIGS = {
    "hca4_csa8_window7_no_hash": (
        dict(layer_types=[H, C, S, H], compress_rates={C: 8, H: 4}, sliding_window=7, mlp_layer_types=["moe"] * 4),
        [5, 77, 301],
        37,
    ),
    "odd_heads_hc1_all_hash": (
        dict(
            num_attention_heads=3,
            o_groups=3,
            index_n_heads=3,
            hc_mult=1,
            layer_types=[C, C, H, S],
            mlp_layer_types=["hash_moe"] * 4,
        ),
        [9, 130, 260],
        50,
    ),
    "topk1_hc2_window32_rate32": (
        dict(index_topk=1, hc_mult=2, sliding_window=32, compress_rates={C: 4, H: 32}, layer_types=[S, H, C, C]),
        [40, 129, 400],
        64,
    ),
    "all_csa_topk_over_entries": (dict(layer_types=[C] * 4, index_topk=64, num_experts_per_tok=3), [15, 200, 333], 45),
    "all_hca_default_rope_half_rotary": (
        dict(
            layer_types=[H] * 4,
            partial_rotary_factor=0.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        [3, 250],
        30,
    ),
    "all_sliding_window3": (dict(layer_types=[S] * 4, sliding_window=3), [2, 64], 13),
    "tied_embeddings_hc4_groups1": (
        dict(tie_word_embeddings=True, hc_mult=4, o_groups=1, layer_types=[C, H, S, C]),
        [31, 190],
        128,
    ),
    "legacy_compress_ratios_hash2": (
        dict(
            layer_types=None,
            compress_ratios=[0, 4, 128, 4, 0],
            num_hash_layers=2,
            mlp_layer_types=None,
            compress_rate_hca=16,
        ),
        [17, 300],
        70,
    ),
    "window2_csa2_index_heads1": (
        dict(sliding_window=2, compress_rates={C: 2, H: 8}, index_n_heads=1, layer_types=[C, S, H, C]),
        [6, 90],
        11,
    ),
    "hca128_long_prompt": (dict(compress_rates={C: 4, H: 128}, layer_types=[H, C, H, S]), [700], 300),
    "one_layer_csa_sigmoid": (
        dict(num_hidden_layers=1, layer_types=[C], mlp_layer_types=["moe"], scoring_func="sigmoid"),
        [50, 260],
        33,
    ),
    "six_layers_sinkhorn1": (
        dict(
            num_hidden_layers=6,
            layer_types=[S, C, H, C, H, S],
            mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3,
            hc_sinkhorn_iters=1,
        ),
        [12, 210],
        64,
    ),
    "topk_all_experts_head24": (
        dict(num_experts_per_tok=6, head_dim=24, partial_rotary_factor=0.25, index_head_dim=12),
        [20, 150],
        7,
    ),
    "csa3_hca6_block126": (dict(compress_rates={C: 3, H: 6}, layer_types=[S, C, H, C]), [40, 200], 50),
}
BLOCK_SIZES = {"csa3_hca6_block126": 126}  # rates that do not divide 128 need a block size they divide
CI_CONFIGS = ["hca4_csa8_window7_no_hash", "odd_heads_hc1_all_hash", "topk1_hc2_window32_rate32"]
NEW = 8


def config(**overrides):
    kw = dict(
        vocab_size=VOCAB, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, head_dim=16, q_lora_rank=24, partial_rotary_factor=0.25,
        num_experts_per_tok=2, n_routed_experts=6, routed_scaling_factor=1.5, swiglu_limit=0.5,
        layer_types=[S, C, H, C], compress_rates={C: 4, H: 16}, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        hc_mult=3, hc_sinkhorn_iters=5, sliding_window=16, o_groups=2, o_lora_rank=8,
        index_n_heads=4, index_head_dim=8, index_topk=5, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                         "beta_fast": 32, "beta_slow": 1},
        initializer_range=0.1, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0,
    )  # fmt: skip
    kw.update(overrides)
    return transformers.DeepseekV4Config(**{k: v for k, v in kw.items() if v is not None})


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("name", list(CONFIGS) if os.environ.get("DEEPINFER_V4_SWEEP") else CI_CONFIGS)
def test_config_matches_transformers(name, tmp_path):
    overrides, lens, budget = CONFIGS[name]
    torch.manual_seed(len(name))
    hf = transformers.DeepseekV4ForCausalLM(config(**overrides)).eval()
    randomise_zero_initialised(hf, 3)
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(41)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lens]
    block = BLOCK_SIZES.get(name, 128)
    llm = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        kv_cache_blocks=24,
        max_num_batched_tokens=budget,
        block_size=block,
    )
    longest = prompts[-1]
    with torch.no_grad():
        ref = hf(torch.tensor([longest])).logits[0].float()
    err = (llm.engine.prompt_logits(longest) - ref).abs().max().item()
    assert err < 1e-4, f"{name}: logits differ by {err}"
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    ]
    with torch.no_grad():
        want = [
            hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW,
                do_sample=False,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    assert got == want, name
    # Again: prompts past one KV block hit the prefix cache (state KV rebuilt by replay).
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.num_cached_tokens for o in again] == [(n - 1) // block * block for n in lens]
    assert [o.outputs[0].token_ids for o in again] == want, name

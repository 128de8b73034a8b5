"""Whole models through the plugin on a GPU, with configurations and batches no other test uses,
against the core's reference path on the same GPU (builtin attention and MoE, no fused ops,
eager) in float32: a Llama/Qwen-like model with attention biases, tied embeddings, MQA, a hidden
size that is not a multiple of 128, an odd vocabulary and heads not a power of two; one with
8-wide heads; a tiny DeepSeek-V3 (MLA, group-limited routing, shared expert) and one whose top-k
is every expert. Requests of mixed prompt lengths (1, 127-129, 300 tokens) and output lengths,
so that decode batches shrink through many CUDA-graph buckets (257 requests: past the 256
bucket), chunked prefill over cached prefixes that end inside a block, seeded top-k / top-p
sampling in graphs and eagerly, and batch-invariant mode alone vs in a batch of 65.

Greedy tokens must be identical; where they are not, the first difference must be a float32
near-tie in transformers' own logits (a margin under 1e-4), else the test fails.
Skipped without CUDA: the plugin answers only for CUDA platforms (the kernels themselves run in
Triton's interpreter in test_offpath_attention.py and test_offpath_moe.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the plugin's model path needs a CUDA device")

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.testing.greedy_check import assert_same_or_near_tie  # noqa: E402
from deepinfer_core.testing.v3_checkpoint import rewrite_as_fp8_blocks, tiny_deepseek_v3  # noqa: E402

REFERENCE = dict(attention_backend="builtin", moe_backend="builtin", fused_ops=False, enforce_eager=True)


def llama_like(path, **overrides):
    kw = dict(vocab_size=1001, hidden_size=200, intermediate_size=344, num_hidden_layers=2, num_attention_heads=5,
              num_key_value_heads=1, head_dim=40, attention_bias=True, tie_word_embeddings=True,
              max_position_embeddings=2048, initializer_range=0.15, bos_token_id=0, eos_token_id=1,
              rope_theta=10000.0)  # fmt: skip
    kw.update(overrides)
    cfg = transformers.LlamaConfig(**kw)
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # biases are zero-initialised: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


def deepseek_v3(path, experts=16, top_k=3, groups=4, topk_groups=2):
    return tiny_deepseek_v3(
        path, seed=5, router_gain=6.0,
        vocab_size=517, hidden_size=72, intermediate_size=136, moe_intermediate_size=40,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=6, num_key_value_heads=6,
        q_lora_rank=48, kv_lora_rank=40, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
        n_routed_experts=experts, num_experts_per_tok=top_k, n_group=groups, topk_group=topk_groups, n_shared_experts=1,
        routed_scaling_factor=2.0, max_position_embeddings=2048, initializer_range=0.1,
    )  # fmt: skip


def fp8_deepseek_v3(path):
    """A DeepSeek-V3 FP8 block checkpoint (e4m3 + a float32 scale per 128 x 128 tile, the released
    per-expert layout) whose hidden size (200) and dense width (328) are not multiples of 128:
    the loader keeps FP8 what the kernels take (experts: 128 wide) and dequantizes the rest.
    Returns transformers' model holding the dequantized bytes (for the near-tie check)."""
    hf = tiny_deepseek_v3(
        path, seed=8,
        vocab_size=333, hidden_size=200, intermediate_size=328, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=3, num_key_value_heads=3,
        q_lora_rank=160, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=48,
        n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.0, max_position_embeddings=1024, initializer_range=0.1,
    )  # fmt: skip
    rewrite_as_fp8_blocks(path, hf)
    return hf


def mixed_prompts(n, vocab, seed=0, share=True):
    """n prompts: lengths cycle through block and chunk boundaries; with ``share`` every fifth
    starts with one 300-token prefix (prefix-cache hits of two whole blocks, then the rest)."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 127, 128, 129, 300, 2, 17, 63, 65, 255]
    shared = torch.randint(2, vocab, (300,), generator=g).tolist()
    out = []
    for i in range(n):
        p = torch.randint(2, vocab, (lens[i % len(lens)],), generator=g).tolist()
        out.append(shared + p[:40] if share and i % 5 == 0 else p)
    return out


def generate(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def greedy(n):
    """Output lengths 1-24, so the decode batch shrinks step by step through the buckets."""
    return [SamplingParams(temperature=0, max_tokens=1 + (i * 7) % 24, ignore_eos=True) for i in range(n)]


def test_llama_like_257_requests_graphs_and_chunked_prefill(tmp_path):
    hf = llama_like(tmp_path)
    prompts = mixed_prompts(257, 1001)
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=900, max_num_seqs=257, max_num_batched_tokens=1000)
    ours = LLM(str(tmp_path), **kw)
    assert (
        ours.engine.runner.graphs is not None
        and 256 in ours.engine.runner.graphs.graphs
        and 257 in ours.engine.runner.graphs.graphs
    )
    got = generate(ours, prompts, greedy(257))
    del ours
    want = generate(LLM(str(tmp_path), **kw, **REFERENCE), prompts, greedy(257))
    assert_same_or_near_tie(got, want, prompts, hf)


def test_llama_like_long_contexts(tmp_path):
    """Prompts of 4,095 / 4,097 / 8,000 tokens beside a 1-token one: decode crosses the 32nd and
    63rd block and splits the KV (graphs), prefill runs in 2,048-token chunks."""
    hf = llama_like(tmp_path, max_position_embeddings=8192)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 1001, (n,), generator=g).tolist() for n in (4095, 4097, 1, 8000)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=160, max_num_seqs=4)
    got = generate(LLM(str(tmp_path), **kw), prompts, params)
    want = generate(LLM(str(tmp_path), **kw, **REFERENCE), prompts, params)
    assert_same_or_near_tie(got, want, prompts, hf)


def test_llama_heads_8_wide(tmp_path):
    """head_dim 8: narrower than a tensor-core tile (the kernel pads the dot to 16 channels)."""
    hf = llama_like(tmp_path, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                    intermediate_size=96, attention_bias=False, tie_word_embeddings=False)  # fmt: skip
    prompts = mixed_prompts(20, 1001, seed=1)
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=200, max_num_seqs=32)
    got = generate(LLM(str(tmp_path), **kw), prompts, greedy(20))
    want = generate(LLM(str(tmp_path), **kw, **REFERENCE), prompts, greedy(20))
    assert_same_or_near_tie(got, want, prompts, hf)


@pytest.mark.parametrize(
    "experts,top_k,groups,topk_groups",
    [(16, 3, 4, 2), (24, 3, 4, 2), (4, 4, 1, 1)],
    ids=["grouped", "grouped-24-torch-routing", "topk-all"],
)  # 24 experts in 4 groups: not the fused routing kernel's power of two, the reference routing inside the graphs
def test_deepseek_v3_tiny(tmp_path, experts, top_k, groups, topk_groups):
    hf = deepseek_v3(tmp_path, experts, top_k, groups, topk_groups)
    prompts = mixed_prompts(65, 517, seed=2)
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=400, max_num_seqs=65, max_num_batched_tokens=700)
    got = generate(LLM(str(tmp_path), **kw), prompts, greedy(65))
    want = generate(LLM(str(tmp_path), **kw, **REFERENCE), prompts, greedy(65))
    assert_same_or_near_tie(got, want, prompts, hf)


def test_deepseek_v3_fp8_with_a_hidden_size_not_a_multiple_of_128(tmp_path):
    """float32 activations multiply the FP8 weights widened exactly (the plugin's FP8 GEMMs and
    fused MoE) vs the reference path's dequantized weights: the same products."""
    from deepinfer_core.models.fp8 import Fp8Experts, Fp8Linear

    hf = fp8_deepseek_v3(tmp_path)
    prompts = mixed_prompts(20, 333, seed=6)
    # steps of at most 16 tokens: one tiling of each FP8 kernel (float32 compiles are slow)
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=200, max_num_seqs=16, max_num_batched_tokens=16)
    ours = LLM(str(tmp_path), **kw)
    kinds = {type(m) for m in ours.engine.runner.model.modules()}
    assert Fp8Experts in kinds and Fp8Linear in kinds, "the plugin should keep this checkpoint's experts FP8"
    got = generate(ours, prompts, greedy(20))
    del ours
    want = generate(LLM(str(tmp_path), **kw, **REFERENCE), prompts, greedy(20))
    assert_same_or_near_tie(got, want, prompts, hf)


def test_seeded_sampling_in_graphs_equals_eager(tmp_path):
    """Seeded top-k / top-p / min-p sampling: replayed graphs (padded buckets) give the eager
    engine's tokens, request for request (the noise depends only on the seed and position)."""
    llama_like(tmp_path)
    prompts = mixed_prompts(40, 1001, seed=3)
    params = [SamplingParams(temperature=0.8, top_k=(0, 5, 50)[i % 3], top_p=(1.0, 0.7, 0.95)[i % 3],
                             min_p=0.05 * (i % 2), seed=100 + i, max_tokens=3 + i % 20, ignore_eos=True)
              for i in range(40)]  # fmt: skip
    kw = dict(device="cuda", dtype="float32", kv_cache_blocks=300, max_num_seqs=40)
    graphed = LLM(str(tmp_path), **kw)
    assert graphed.engine.runner.graphs.graphs
    got = generate(graphed, prompts, params)
    del graphed
    assert got == generate(LLM(str(tmp_path), **kw, enforce_eager=True), prompts, params)


def test_batch_invariant_alone_and_in_a_batch_of_65(tmp_path):
    llama_like(tmp_path, num_key_value_heads=5)
    prompts = mixed_prompts(65, 1001, seed=4, share=False)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = LLM(
        str(tmp_path),
        device="cuda",
        dtype="bfloat16",
        kv_cache_blocks=400,
        max_num_seqs=65,
        batch_invariant=True,
        enable_prefix_caching=False,
    )
    batch = generate(llm, prompts, params)
    for i in (0, 3, 64):
        assert generate(llm, [prompts[i]], params)[0] == batch[i], (
            f"request {i} alone differs from its place in the batch"
        )

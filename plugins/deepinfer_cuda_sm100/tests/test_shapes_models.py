"""Whole DeepSeek-V3-style models with unusual but valid settings through the plugin's kernels
against the builtin reference path, float32 greedy tokens: 6 routed experts in 2 groups (not
the fused routing's power of two), top-1, no query LoRA (``q_lora_rank: null``), every layer
MoE (``first_k_dense_replace: 0``), an odd vocabulary; and 32 experts in 4 groups keeping 3,
top-8 unnormalised, a value head narrower than the key's nope part, an odd latent width.

On the CPU (CI) the plugin's attention, MoE dispatcher and fused ops are put in place of the
host's answers (its hooks answer for CUDA platforms only) and run in Triton's interpreter, at
the smallest sizes; on a GPU the plugin's own defaults run (graphs, overlap) on more requests.
Tokens must be identical; at a first difference transformers' float32 logits must call it a
near-tie (< 1e-4), else it is a bug.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.plugin_host import PluginHost  # noqa: E402
from deepinfer_core.testing.greedy_check import assert_same_or_near_tie  # noqa: E402
from deepinfer_core.testing.v3_checkpoint import tiny_deepseek_v3  # noqa: E402

CUDA = torch.cuda.is_available()
REFERENCE = dict(attention_backend="builtin", moe_backend="builtin", fused_ops=False, enforce_eager=True)
CONFIGS = {
    "e6-top1-groups2-nolora-alldense0": dict(
        vocab_size=521, hidden_size=40, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=2,
        first_k_dense_replace=0, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=None, kv_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=6, num_experts_per_tok=1, n_group=2,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5,
    ),
    "e32-top8-groups4of3-unnormalised": dict(
        vocab_size=333, hidden_size=48, intermediate_size=88, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=5, num_key_value_heads=5, q_lora_rank=24, kv_lora_rank=20,
        qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=12, n_routed_experts=32, num_experts_per_tok=8, n_group=4,
        topk_group=3, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0,
    ),
}  # fmt: skip


def checkpoint(path, name):
    # routing that matters: sharp gates, a correction bias
    model = tiny_deepseek_v3(
        path, seed=7, router_gain=6.0, **CONFIGS[name], max_position_embeddings=1024, initializer_range=0.1
    )
    return model, model.config


@pytest.fixture
def plugin_on_cpu(monkeypatch):
    """The host answers with the plugin's Triton attention, MoE dispatcher and fused ops for
    every layer (unless a backend is named: the reference run names "builtin")."""
    from dataclasses import replace

    from deepinfer_cuda_sm100.attention import TritonAttention
    from deepinfer_cuda_sm100.kernels import fused_elementwise
    from deepinfer_cuda_sm100.kernels.fused_elementwise import FUSED_OPS
    from deepinfer_cuda_sm100.kernels.logits import lm_logits
    from deepinfer_cuda_sm100.moe import TritonMoEDispatcher

    attention, moe = PluginHost.attention_backend, PluginHost.moe_dispatcher
    monkeypatch.setattr(
        PluginHost,
        "attention_backend",
        lambda self, layer, platform, name=None: (
            TritonAttention() if name is None else attention(self, layer, platform, name)
        ),
    )
    monkeypatch.setattr(
        PluginHost,
        "moe_dispatcher",
        lambda self, m, platform, parallel=None, name=None: (
            TritonMoEDispatcher() if name is None else moe(self, m, platform, parallel, name)
        ),
    )
    monkeypatch.setattr(PluginHost, "fused_ops", lambda self, platform: replace(FUSED_OPS, logits=lm_logits))
    monkeypatch.setattr(
        fused_elementwise, "ROPE_CAT_TILE_TOKENS", 0
    )  # rope_cat's per-token form: the interpreter's cost is per program


def run(path, prompts, params, **kw):
    llm = LLM(str(path), dtype="float32", **kw)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return out, llm


@pytest.mark.skipif(CUDA, reason="the GPU variant below runs the plugin's own defaults")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_unusual_deepseek_v3_on_the_plugin_kernels_in_the_interpreter(tmp_path, name, plugin_on_cpu):
    from deepinfer_cuda_sm100.attention import TritonAttention
    from deepinfer_cuda_sm100.moe import TritonMoEDispatcher

    hf, cfg = checkpoint(tmp_path, name)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (1, 11)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = dict(device="cpu", kv_cache_blocks=8, max_num_seqs=4, block_size=16)
    got, ours = run(tmp_path, prompts, params, **kw)
    kinds = {type(m) for m in ours.engine.model.modules()} | {
        type(getattr(m, "backend", None)) for m in ours.engine.model.modules()
    }
    kinds |= {type(getattr(m, "dispatcher", None)) for m in ours.engine.model.modules()}
    assert TritonAttention in kinds and TritonMoEDispatcher in kinds, "the plugin's kernels were not in place"
    want, _ = run(tmp_path, prompts, params, **kw, **REFERENCE)
    assert_same_or_near_tie(got, want, prompts, hf)


@pytest.mark.skipif(
    not CUDA, reason="the plugin's own defaults need a CUDA device (the interpreter variant runs above)"
)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_unusual_deepseek_v3_through_the_plugin_on_the_gpu(tmp_path, name):
    hf, cfg = checkpoint(tmp_path, name)
    g = torch.Generator().manual_seed(2)
    lens = [1, 2, 17, 127, 128, 129, 300, 63, 65, 255]
    prompts = [torch.randint(2, cfg.vocab_size, (lens[i % len(lens)],), generator=g).tolist() for i in range(33)]
    params = [SamplingParams(temperature=0, max_tokens=1 + (i * 7) % 24, ignore_eos=True) for i in range(33)]
    kw = dict(device="cuda", kv_cache_blocks=200, max_num_seqs=33, max_num_batched_tokens=600)
    got, ours = run(tmp_path, prompts, params, **kw)
    del ours
    want, _ = run(tmp_path, prompts, params, **kw, **REFERENCE)
    assert_same_or_near_tie(got, want, prompts, hf.to("cpu"))

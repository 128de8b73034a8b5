"""A tiny DeepSeek-V3 whose MLA prefill steps run in the non-absorbed form
(``TritonAttention.forward_mla_expanded``) gives the reference's float32 greedy tokens: whole
prompts, chunked prefill over a cached prefix, then absorbed decode from the same cache.

Without a GPU the kernels run in Triton's interpreter through a test provider that offers
``TritonAttention`` (expanding every prefill-like step) on any platform, and the tokens are
transformers' (which decompresses keys and values as the expanded form does, but in its own
code; tests/test_engine_deepseek_v3.py checks the builtin path against it). On a GPU the
plugin's own hooks and thresholds run and the tokens are the builtin path's on the same GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")
transformers = pytest.importorskip("transformers")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.hookspecs import hookimpl  # noqa: E402
from deepinfer_core.plugin_host import PluginHost  # noqa: E402
from deepinfer_cuda_sm100.attention import TritonAttention  # noqa: E402

CUDA = torch.cuda.is_available()
LENS = (9, 70) if not CUDA else (5, 40, 130, 300, 600)
NEW = 5 if not CUDA else 24


class CountingTritonAttention(TritonAttention):
    """Expands every step with a multi-token request (the plugin's own choice, tested in
    test_mla_prefill.py, would leave these tiny steps absorbed) and counts the layer calls that
    ran expanded, with and without a cached prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"whole": 0, "prefix": 0}

    def expand_mla(self, spec, meta):
        return meta.max_query_len > 1 and meta.num_context_tokens > 0

    def forward_mla_expanded(self, spec, q, key, kv_b_weight, kv_cache, meta):
        self.calls["whole" if meta.num_context_tokens == q.shape[0] else "prefix"] += 1
        return super().forward_mla_expanded(spec, q, key, kv_b_weight, kv_cache, meta)


class ExpandEverywhere:
    """Offers one counting Triton backend for MLA layers."""

    def __init__(self) -> None:
        self.backend = CountingTritonAttention()

    @hookimpl
    def deepinfer_attention_backend(self, layer, platform):
        return self.backend if layer.kind.value == "mla" else None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, max_position_embeddings=1024, initializer_range=0.08, bos_token_id=0,
        eos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(21)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("dsv3-expanded")
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in LENS]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    if CUDA:
        ref = LLM(
            str(path),
            device="cuda",
            dtype="float32",
            kv_cache_blocks=64,
            attention_backend="builtin",
            moe_backend="builtin",
        )
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
        del ref
        return str(path), prompts, want
    want = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    return str(path), prompts, want


# CPU: one run, chunked (32-token steps: the 70-token prompt's later chunks see a cached prefix;
# its first step holds the whole 9-token prompt); GPU: whole prompts and chunks
@pytest.mark.parametrize("budget", [None, 128] if CUDA else [32], ids=["whole", "chunked"] if CUDA else ["chunked"])
def test_greedy_tokens_equal_the_reference_with_expanded_prefill(checkpoint, budget):
    path, prompts, want = checkpoint
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    if CUDA:  # the plugin's own hooks and thresholds
        llm = LLM(path, device="cuda", dtype="float32", kv_cache_blocks=64, block_size=16, **kw)
        backends = {
            m.backend for m in llm.engine.model.modules() if isinstance(getattr(m, "backend", None), TritonAttention)
        }
        assert len(backends) == 2
        calls = {"whole": 0, "prefix": 0}
        for b in backends:
            run = b.forward_mla_expanded

            def counted(spec, q, key, w, cache, meta, run=run):
                calls["whole" if meta.num_context_tokens == q.shape[0] else "prefix"] += 1
                return run(spec, q, key, w, cache, meta)

            b.forward_mla_expanded = counted
    else:
        provider = ExpandEverywhere()
        host = PluginHost(load_entry_points=False, extra_plugins={"expand": provider})
        llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, block_size=16, host=host, **kw)
        calls = provider.backend.calls
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    ]
    assert got == want
    assert calls["whole"] > 0
    if budget is not None:
        assert calls["prefix"] > 0

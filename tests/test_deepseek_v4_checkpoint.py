"""A tiny DeepSeek-V4 checkpoint in the released FP8 / MXFP4 layout, end to end: the engine
loads it and matches transformers run on the weights transformers itself dequantizes; and
``deepinfer plan`` agrees with the V4 engine's allocation."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.fail("transformers >= 5.24 (DeepseekV4) is required for the DeepSeek-V4 tests")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine.config import EngineConfig  # noqa: E402
from deepinfer_core.engine.kv_sizing import cache_bytes  # noqa: E402
from deepinfer_core.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer_core.plan import plan  # noqa: E402
from deepinfer_core.testing.v4_checkpoint import TINY_V4_CONFIG, write_tiny_v4_checkpoint  # noqa: E402

PROMPT_LENS = [10, 45, 150]
NEW = 8


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The FP8 / MXFP4 checkpoint, and transformers' model loaded from it with its own dequant."""
    path = tmp_path_factory.mktemp("v4_fp8")
    write_tiny_v4_checkpoint(path, weights="fp8", experts="fp4", seed=3)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)
    ).eval()
    hf.generation_config.eos_token_id = None
    return str(path), hf


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, TINY_V4_CONFIG["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_fp8_fp4_checkpoint_logits_match_transformers(quantized):
    path, hf = quantized
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16)
    for p in prompts():
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        ours = llm.engine.prompt_logits(p)
        assert (ours - ref).abs().max().item() < 1e-4, f"prompt of {len(p)} tokens"


def test_fp8_fp4_checkpoint_greedy_tokens_match_transformers(quantized):
    path, hf = quantized
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16)
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


def test_fp8_projections_kept_fp8_match_transformers(quantized, monkeypatch):
    """Where the platform has an FP8 GEMM the engine keeps the released FP8 projections (e4m3
    bytes + UE8M0 tile scales) as they are. The CPU has no such kernel, so the check that offers
    one is bypassed here: each kept module then dequantizes on the fly, which must give
    transformers' logits and tokens as dequantizing at load does."""
    from deepinfer_core.engine import loading
    from deepinfer_core.models.fp8 import Fp8Linear, swap_in_fp8

    path, hf = quantized
    monkeypatch.setattr(loading, "keep_fp8", lambda model, files, host, platform: swap_in_fp8(model, files.fp8_names))
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16)
    kept = {n for n, m in llm.engine.model.named_modules() if isinstance(m, Fp8Linear)}
    layers = TINY_V4_CONFIG["num_hidden_layers"]
    assert {f"model.layers.{i}.self_attn.q_a_proj" for i in range(layers)} <= kept
    assert {f"model.layers.{i}.mlp.shared_experts.down_proj" for i in range(layers)} <= kept
    fp8 = [m for m in llm.engine.model.modules() if isinstance(m, Fp8Linear)]
    assert all(m.qweight.dtype == torch.uint8 for m in fp8)  # the stored bytes, not widened by .to(dtype)
    for p in prompts():
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        assert (llm.engine.prompt_logits(p) - ref).abs().max().item() < 1e-4, f"prompt of {len(p)} tokens"
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    want = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16).generate(
        prompts(), SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("kv_gib, max_num_seqs", [(0.02, 2), (0.05, 8)])
def test_v4_plan_is_what_the_engine_allocates(quantized, kv_gib, max_num_seqs):
    path, _ = quantized
    p = plan(path, kv_gib, dtype="float32", max_num_seqs=max_num_seqs, max_model_len=1000)
    engine = LLMEngine(
        EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_gib=kv_gib, max_num_seqs=max_num_seqs)
    )
    assert engine.num_blocks == p.blocks
    assert cache_bytes(engine.runner.kv_caches) == p.total_bytes <= kv_gib * 2**30
    assert p.state_bytes_per_request > 0 and p.state_slots == max_num_seqs + 1
    # Block KV per token from the definition of compressed entries: a CSA layer keeps one
    # (head_dim + index_head_dim)-wide entry per `ratio` tokens, an HCA layer one head_dim-wide
    # entry per `ratio'` tokens, a sliding layer nothing (its window is state KV).
    c = TINY_V4_CONFIG
    per_kind = {r.kind: r.bytes_per_token for r in p.kinds}
    assert (
        per_kind["compressed_sparse_attention"] == 2 * (c["head_dim"] + c["index_head_dim"]) / 4 * 4
    )  # 2 CSA layers, ratio 4, fp32
    assert per_kind["heavily_compressed_attention"] == 1 * c["head_dim"] / c["compress_rate_hca"] * 4
    assert per_kind.get("sliding_attention", 0) == 0
    # `concurrent_requests` of 1000 tokens fit with max_num_seqs set to that number, one more does not.
    n, per_request = p.concurrent_requests, p.blocks_per_request
    fits = plan(path, kv_gib, dtype="float32", max_num_seqs=n, max_model_len=1000)
    assert fits.blocks >= n * per_request
    more = plan(path, kv_gib, dtype="float32", max_num_seqs=n + 1, max_model_len=1000)
    assert more.blocks < (n + 1) * per_request


def test_the_model_is_allocated_in_its_dtype(quantized, monkeypatch):
    """The V4 model is cast on the meta device and only then allocated: a bf16 engine never holds
    its weights in float32 (that doubled the GPU's load peak: 17.5 GB for V4-mini's 8.5 GB file)."""
    allocated = _spy_allocation(monkeypatch)
    llm = LLM(quantized[0], device="cpu", dtype="bfloat16", kv_cache_blocks=16)
    model = llm.engine.model
    held = list(model.parameters()) + list(model.buffers())
    fp32 = sum(t.numel() * t.element_size() for t in held if t.dtype == torch.float32)
    assert allocated[torch.float32] == fp32  # only what the model keeps float32 (mixing, sinks, norms, biases)
    assert allocated[torch.bfloat16] == sum(t.numel() * t.element_size() for t in held if t.dtype == torch.bfloat16)


def _spy_allocation(monkeypatch) -> dict[torch.dtype, int]:
    """Bytes by dtype of what a model allocates when it leaves the meta device."""
    from deepinfer_core.models import fast_init

    allocated: dict[torch.dtype, int] = {}
    real = fast_init.materialize

    def spy(module, device):
        for t in list(module.parameters()) + list(module.buffers()):
            allocated[t.dtype] = allocated.get(t.dtype, 0) + t.numel() * t.element_size()
        return real(module, device)

    monkeypatch.setattr(fast_init, "materialize", spy)
    return allocated


def test_kept_fp8_and_mxfp4_weights_are_allocated_packed(tmp_path, monkeypatch):
    """Where a platform keeps FP8 projections and MXFP4 experts packed, the modules holding
    them replace the dense ones on the meta device: the model allocates what it then holds and
    nothing more (the dense bf16 projections and experts used to be allocated first and dropped
    at the swap: a load peak of the whole dense model). A provider offers the two kernels on the
    CPU here (dequantize, then a float GEMM), so the packed engine must also give the dense
    engine's greedy tokens."""
    from deepinfer_core.fused_ops import FusedOps
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.models.fp8 import Fp8Linear, dequantize
    from deepinfer_core.models.mxfp4 import Mxfp4Experts
    from deepinfer_core.plugin_host import PluginHost

    class Offers:
        @hookimpl
        def deepinfer_fused_ops(self, platform):
            return FusedOps(
                fp8_linear=lambda x, w, s: torch.nn.functional.linear(x, dequantize(w, s).to(x.dtype)),
                mxfp4_moe=lambda *a, **k: None,  # never called: the builtin dispatcher widens per call
            )

    write_tiny_v4_checkpoint(tmp_path, weights="fp8", experts="fp4", seed=5)
    allocated = _spy_allocation(monkeypatch)
    host = PluginHost(load_entry_points=False, extra_plugins={"ops": Offers()})
    llm = LLM(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_blocks=16, host=host, fused_ops=False)
    model = llm.engine.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert any(isinstance(m, Mxfp4Experts) for m in model.modules())
    held: dict[torch.dtype, int] = {}
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            held[t.dtype] = held.get(t.dtype, 0) + t.numel() * t.element_size()
    assert allocated == held
    dense = LLM(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_blocks=16, fused_ops=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, TINY_V4_CONFIG["vocab_size"], (n,), generator=g).tolist() for n in (9, 21)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in dense.generate(prompts, params)]

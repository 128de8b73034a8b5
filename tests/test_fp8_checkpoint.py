"""DeepSeek-V3 FP8 block checkpoints (``weight`` float8_e4m3fn + ``weight_scale_inv`` per 128 x 128
tile, DeepSeek's released format), against transformers.

A tiny random V3 is saved by transformers; its projections are quantized to the released format
(amax / 448 per tile, float32 scales: ``deepinfer_core.testing.v3_checkpoint``, not the loader's
code) and the checkpoint rewritten. The expected model
is transformers' own with each projection replaced by the test's dequantization of those bytes:
deepinfer must reproduce its greedy tokens both when it dequantizes at load (the CPU default)
and when it keeps the weights FP8 (what it does on a GPU with FP8 kernels; forced here).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.engine import loading  # noqa: E402
from deepinfer_core.models import WeightsError  # noqa: E402
from deepinfer_core.models.fp8 import Fp8Experts, Fp8Linear, swap_in_fp8  # noqa: E402
from deepinfer_core.testing.v3_checkpoint import rewrite_as_fp8_blocks, tiny_deepseek_v3  # noqa: E402

NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3fp8")
    hf = tiny_deepseek_v3(
        path, seed=99,
        vocab_size=320, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=160, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.0, max_position_embeddings=256, initializer_range=0.1,
    )  # fmt: skip
    tensors = rewrite_as_fp8_blocks(path, hf)  # hf now holds the dequantized bytes: the expected model
    assert sum(name.endswith("weight_scale_inv") for name in tensors) > 20
    hf.generation_config.eos_token_id = None
    return path, hf


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 17, 40)]


def expected(hf):
    out = []
    for p in prompts():
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW,
                do_sample=False,
            )
        out.append(ref[0, len(p) :].tolist())
    return out


def generate(path):
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_blocks=8, max_num_seqs=4)
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def test_dequantized_at_load_matches_transformers(checkpoint):
    path, hf = checkpoint
    llm, got = generate(path)
    assert not any(isinstance(m, (Fp8Linear, Fp8Experts)) for m in llm.engine.runner.model.modules())
    assert got == expected(hf)


def test_kept_fp8_matches_transformers(checkpoint, monkeypatch):
    path, hf = checkpoint
    monkeypatch.setattr(loading, "keep_fp8", lambda model, files, host, platform: swap_in_fp8(model, files.fp8_names))
    llm, got = generate(path)
    model = llm.engine.runner.model
    layer0, layer1 = model.model.layers
    assert isinstance(layer0.mlp.gate_up_proj, Fp8Linear) and isinstance(layer0.mlp.down_proj, Fp8Linear)
    assert isinstance(layer1.mlp.experts, Fp8Experts) and isinstance(layer1.mlp.shared_experts.gate_up_proj, Fp8Linear)
    assert isinstance(layer0.self_attn.q_a_proj, Fp8Linear) and isinstance(
        layer0.self_attn.kv_a_proj_with_mqa, Fp8Linear
    )
    assert not isinstance(layer0.self_attn.kv_b_proj, Fp8Linear)  # viewed per head by MLA: dequantized
    assert layer1.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert got == expected(hf)


def test_bad_fp8_checkpoints_are_refused_by_name(checkpoint, tmp_path):
    import shutil

    path, _ = checkpoint
    bad = tmp_path / "block64"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weight_block_size"):
        LLM(str(bad), device="cpu", kv_cache_blocks=8)

    unscaled = tmp_path / "unscaled"
    shutil.copytree(path, unscaled)
    tensors = safetensors_torch.load_file(str(unscaled / "model.safetensors"))
    tensors.pop("model.layers.0.self_attn.o_proj.weight_scale_inv")
    safetensors_torch.save_file(tensors, str(unscaled / "model.safetensors"))
    with pytest.raises(WeightsError, match="o_proj.weight: FP8 weight without"):
        LLM(str(unscaled), device="cpu", kv_cache_blocks=8)

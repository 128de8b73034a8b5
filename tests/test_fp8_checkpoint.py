"""DeepSeek-V3 FP8 block checkpoints (``weight`` float8_e4m3fn + ``weight_scale_inv`` per 128 x 128
tile, DeepSeek's released format), against transformers.

A tiny random V3 is saved by transformers; the test quantizes its projections to the released
format itself (amax / 448 per tile, float32 scales) and writes the checkpoint. The expected model
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

NEW = 12


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The released format: per 128 x 128 tile, scale = amax / 448, values w / scale in e4m3."""
    rows, cols = w.shape
    pad = torch.nn.functional.pad(w, (0, -cols % 128, 0, -rows % 128))
    tiles = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [R, 128, C, 128]
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [R, C]
    q = (tiles / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale.float()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * full


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = transformers.DeepseekV3Config(
        vocab_size=320, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=160, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.0, max_position_embeddings=256, initializer_range=0.1,
        bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(99)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("dsv3fp8")
    hf.save_pretrained(path)
    (path / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    tensors, quantized = {}, 0
    with torch.no_grad():
        experts = state.pop("model.layers.1.mlp.experts.gate_up_proj"), state.pop("model.layers.1.mlp.experts.down_proj")
        for e in range(cfg.n_routed_experts):  # the released per-expert layout
            gate, up = experts[0][e].chunk(2)
            for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", experts[1][e])):
                state[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] = w.contiguous()
        for name, w in state.items():
            if "_proj" in name and name.endswith(".weight") and w.dim() == 2:
                q, s = quantize(w.float())
                tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = q, s
                quantized += 1
            else:
                tensors[name] = w
        for name, p in hf.named_parameters():  # the expected model: the dequantized bytes
            if name.endswith("experts.gate_up_proj"):
                for e in range(cfg.n_routed_experts):
                    g = dequantize(tensors[f"{name[:-13]}.{e}.gate_proj.weight"], tensors[f"{name[:-13]}.{e}.gate_proj.weight_scale_inv"])
                    u = dequantize(tensors[f"{name[:-13]}.{e}.up_proj.weight"], tensors[f"{name[:-13]}.{e}.up_proj.weight_scale_inv"])
                    p[e].copy_(torch.cat([g, u]))
            elif name.endswith("experts.down_proj"):
                for e in range(cfg.n_routed_experts):
                    p[e].copy_(dequantize(tensors[f"{name[:-10]}.{e}.down_proj.weight"], tensors[f"{name[:-10]}.{e}.down_proj.weight_scale_inv"]))
            elif name + "_scale_inv" in tensors:
                p.copy_(dequantize(tensors[name], tensors[name + "_scale_inv"]))
    assert quantized > 20
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    hf.generation_config.eos_token_id = None
    return path, hf


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 17, 40)]


def expected(hf):
    out = []
    for p in prompts():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=NEW, do_sample=False)
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
    assert isinstance(layer0.self_attn.q_a_proj, Fp8Linear) and isinstance(layer0.self_attn.kv_a_proj_with_mqa, Fp8Linear)
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

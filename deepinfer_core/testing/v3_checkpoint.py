"""Tiny DeepSeek-V3 checkpoints from random weights, for tests of engines and plugins.

:func:`tiny_deepseek_v3` saves transformers' own ``DeepseekV3ForCausalLM`` (the independent
reference) and returns it; :func:`rewrite_as_fp8_blocks` turns a saved checkpoint into DeepSeek's
released FP8 layout (``weight`` float8_e4m3fn + ``weight_scale_inv`` per 128 x 128 tile, routed
experts one tensor per expert) and, given the transformers model, makes that model hold exactly
the dequantized bytes, so that a loader which reads the file right reproduces its tokens.
The quantization here is the format's definition (scale = amax / 448 per tile), written without
the engine's loader code, so that tests check the loader against it.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

__all__ = [
    "FP8_QUANTIZATION_CONFIG",
    "SMALL_V3_CONFIG",
    "TINY_V3_CONFIG",
    "fp8_dequantize",
    "fp8_tiles",
    "add_mtp_layers",
    "rewrite_as_fp8_blocks",
    "tiny_deepseek_v3",
]


# Token ids every tiny V3 of the test suites shares; each test picks its own widths and counts.
_COMMON: dict[str, Any] = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None}
# Two layers (one dense, one MoE of 8 experts, top-2 in 2 groups, a shared expert), MLA with a
# query LoRA: the smallest V3 that still runs every kind of layer.
TINY_V3_CONFIG: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "max_position_embeddings": 256, "initializer_range": 0.08,
}  # fmt: skip
# Three layers (one dense, two MoE), a wider vocabulary and value head: the KV-tier tests' model.
SMALL_V3_CONFIG: dict[str, Any] = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "max_position_embeddings": 1024, "initializer_range": 0.08,
}  # fmt: skip
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def tiny_deepseek_v3(path, *, seed: int, router_gain: float | None = None, **config):
    """Build ``DeepseekV3ForCausalLM(DeepseekV3Config(**config))`` from ``torch.manual_seed(seed)``,
    save it to ``path`` and return it in eval mode (float32, on the CPU).

    ``router_gain`` multiplies every MoE router's weight and draws its score-correction bias
    (std 0.1): routing becomes decisive and varied, so that near-ties in the top-k are rare.
    """
    import transformers

    cfg = transformers.DeepseekV3Config(**(_COMMON | config))
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    if router_gain is not None:
        with torch.no_grad():
            for layer in model.model.layers[cfg.first_k_dense_replace :]:
                layer.mlp.gate.weight.mul_(router_gain)
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.1)
    model.save_pretrained(path)
    return model


def fp8_tiles(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The released format of one [rows, cols] weight: per 128 x 128 tile (the last ones partial),
    scale = amax / 448 in float32, values w / scale in e4m3."""
    rows, cols = w.shape
    pad = torch.nn.functional.pad(w.float(), (0, -cols % 128, 0, -rows % 128))
    tiles = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [R, 128, C, 128]
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [R, C]
    q = (tiles / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float().contiguous()


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 values of an FP8 weight: its bytes times their tile's scale."""
    full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * full


def rewrite_as_fp8_blocks(folder, hf=None, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Rewrite the checkpoint in ``folder`` as DeepSeek ships V3: every projection (attention, dense
    MLP, shared and routed experts, the latter split per expert) FP8 with tile scales; embeddings,
    norms, router and head as they were; ``quantization_config`` added to config.json.

    With ``hf`` (the transformers model saved there), its projections are set to the dequantized
    FP8 bytes: the model the checkpoint now holds. Returns the tensors written.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = str(folder)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    state = {}
    for path in files:
        with safe_open(path, framework="pt", device=device) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                base, kind = name.rsplit(".", 1)
                if kind in ("gate_up_proj", "down_proj") and base.endswith("experts"):  # transformers' fused layout
                    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                    for e in range(t.shape[0]):
                        for part, w in zip(parts, t[e].chunk(len(parts))):
                            state[f"{base}.{e}.{part}.weight"] = w.contiguous()
                else:
                    state[name] = t
    tensors = {}
    for name, w in state.items():
        if "_proj" in name and name.endswith(".weight") and w.dim() == 2:
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = fp8_tiles(w)
        else:
            tensors[name] = w
    for path in files + glob.glob(os.path.join(folder, "*.index.json")):
        os.remove(path)
    save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    with open(config_path, "w") as f:
        json.dump(config, f)
    if hf is not None:
        _load_dequantized(hf, tensors)
    return tensors


def _load_dequantized(hf, tensors: dict[str, torch.Tensor]) -> None:
    def dequant(name):
        return fp8_dequantize(tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"])

    with torch.no_grad():
        for name, p in hf.named_parameters():
            base, kind = name.rsplit(".", 1)
            if kind in ("gate_up_proj", "down_proj") and base.endswith("experts"):
                parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                for e in range(p.shape[0]):
                    p[e].copy_(torch.cat([dequant(f"{base}.{e}.{part}.weight") for part in parts]))
            elif name.endswith(".weight") and name[: -len("weight")] + "weight_scale_inv" in tensors:
                p.copy_(dequant(name))


def add_mtp_layers(folder, hf, *, seed: int, count: int = 1) -> list[dict[str, Any]]:
    """Append ``count`` multi-token-prediction layers to the checkpoint in ``folder`` (saved from
    the transformers model ``hf``), as DeepSeek ships them: ``model.layers.{n + k}.*`` holding a
    decoder layer (transformers' own ``DeepseekV3DecoderLayer``, randomly initialised), ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the embedding and LM head;
    ``num_nextn_predict_layers`` set in config.json. Returns, per layer, the transformers modules
    and tensors a reference computation needs (``layer``, ``enorm``, ``hnorm``, ``eh_proj``,
    ``head_norm``): the MTP equations are written against those, not against the engine."""
    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

    folder = str(folder)
    [path] = glob.glob(os.path.join(folder, "*.safetensors"))
    tensors = load_file(path)
    cfg = hf.config
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(seed)
    out = []
    for k in range(count):
        layer = hf_v3.DeepseekV3DecoderLayer(cfg, layer_idx=n + k).eval()
        with torch.no_grad():  # transformers' init leaves some weights empty outside from_pretrained
            for name, p in layer.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) * cfg.initializer_range)
            for name, b in layer.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.1)
        mods = {
            "layer": layer,
            "enorm": 1.0 + 0.1 * torch.randn(d),
            "hnorm": 1.0 + 0.1 * torch.randn(d),
            "eh_proj": torch.randn(d, 2 * d) * cfg.initializer_range,
            "head_norm": 1.0 + 0.1 * torch.randn(d),
        }
        prefix = f"model.layers.{n + k}."
        for name, t in layer.state_dict().items():
            tensors[prefix + name] = t.detach().clone().contiguous()
        tensors[prefix + "enorm.weight"] = mods["enorm"]
        tensors[prefix + "hnorm.weight"] = mods["hnorm"]
        tensors[prefix + "eh_proj.weight"] = mods["eh_proj"]
        tensors[prefix + "shared_head.norm.weight"] = mods["head_norm"]
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        tensors[prefix + "shared_head.head.weight"] = head.clone()
        out.append(mods)
    save_file(tensors, path)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = count
    with open(config_path, "w") as f:
        json.dump(config, f)
    return out

"""Tiny DeepSeek-V4 checkpoints in the released layout, from random weights.

The files use the released model's tensor names, dtypes and quantized formats (BF16, FP8 e4m3
with UE8M0 128 x 128 tile scales, MXFP4 routed experts), sharded with an index, and a config in
the released spelling (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``,
``quantization_config`` + ``expert_dtype``), so that loaders meet what they will meet in the real
files. ``scripts/make_tiny_v4_checkpoint.py`` is the command-line front end.
"""

from __future__ import annotations

import json
import os
from types import MappingProxyType
from typing import Any, Mapping

import torch

from ..models.deepseek_v4.weights import released_tensors
from ..quant import quant_fp4, quant_fp8_block

__all__ = ["FP8_QUANTIZATION", "TINY_V4_CONFIG", "random_released_weights", "write_tiny_v4_checkpoint"]


# Every layer kind (sliding, CSA, HCA), two hash layers, hyper-connections, one MTP block; dims
# that give several FP8 tiles (256 = 2 x 128) and whole MXFP4 groups.
TINY_V4_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "num_hash_layers": 2,
        "compress_ratios": [0, 4, 128, 4, 0],  # the last entry is the MTP block's
        "compress_rate_hca": 8,  # 128 in the release; 8 keeps several entries in short prompts
        "sliding_window": 16,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
)  # read-only: callers copy it (dict(TINY_V4_CONFIG) | overrides)
FP8_QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}


def random_released_weights(
    config: Mapping, *, weights: str = "fp8", experts: str = "fp4", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Released-name tensors for ``config``. ``weights``: ``bf16`` or ``fp8`` (dense projections);
    ``experts``: ``fp4``, ``fp8`` or ``bf16`` (routed experts; ``bf16`` when weights is bf16)."""
    if weights not in ("bf16", "fp8") or experts not in ("fp4", "fp8", "bf16"):
        raise ValueError(f"weights must be bf16 or fp8 and experts fp4, fp8 or bf16; got {weights!r}, {experts!r}")
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, spec in released_tensors(config).items():
        shape = spec.shape
        if spec.kind == "int":  # distinct experts per token id
            rows = [torch.randperm(config["n_routed_experts"], generator=g)[: shape[1]] for _ in range(shape[0])]
            out[name] = torch.stack(rows).to(torch.int32)
            continue
        x = torch.randn(shape, generator=g)
        if len(shape) == 1:  # norms around 1; sinks, biases, mixing bases and scales small
            x = 1.0 + 0.1 * x if name.endswith("norm.weight") or name.endswith("_scale") else 0.1 * x
        elif name.endswith("ape"):
            x = 0.1 * x
        elif name in ("embed.weight", "head.weight") or name.startswith("hc_") or ".hc_" in name:
            x = (0.5 if "embed" in name else 0.05) * x
        else:
            x = x * shape[-1] ** -0.5
        fmt = {"linear": weights, "expert": experts if weights == "fp8" else "bf16"}.get(spec.kind, spec.kind)
        scale_name = name[: -len("weight")] + "scale"
        if fmt == "fp8":
            out[name], out[scale_name] = quant_fp8_block(x)
        elif fmt == "fp4":
            out[name], out[scale_name] = quant_fp4(x)
        elif fmt == "f32":
            out[name] = x.float()
        else:
            out[name] = x.to(torch.bfloat16)
    return out


def write_tiny_v4_checkpoint(
    path: str | os.PathLike,
    *,
    weights: str = "fp8",
    experts: str = "fp4",
    config: Mapping | None = None,
    seed: int = 0,
    shards: int = 2,
) -> dict:
    """Write ``config.json``, ``shards`` safetensors files and their index to ``path``; return the
    config. Consecutive tensors go to alternating shards, so a weight and its scale can sit in
    different files (loaders must pair them by name)."""
    from safetensors.torch import save_file

    config = dict(config or TINY_V4_CONFIG)
    if weights == "fp8":
        config["quantization_config"] = dict(FP8_QUANTIZATION)
        config["expert_dtype"] = experts
    else:
        config.pop("quantization_config", None)
        config.pop("expert_dtype", None)
    tensors = random_released_weights(config, weights=weights, experts=experts, seed=seed)
    os.makedirs(path, exist_ok=True)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts: list[dict[str, torch.Tensor]] = [{} for _ in files]
    for i, (name, tensor) in enumerate(sorted(tensors.items())):
        parts[i % shards][name] = tensor.contiguous()
    weight_map = {}
    for file, part in zip(files, parts):
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map |= {name: file for name in part}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return config

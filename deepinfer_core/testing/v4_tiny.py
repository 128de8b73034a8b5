"""A tiny random DeepSeek-V4 as transformers builds it, shared by the V4 tests and benchmarks.

Every attention kind (sliding, compressed sparse with its indexer, heavily compressed), hash-routed
and learned MoE layers and 3 hyper-connection streams; the window (16), compress rates (4 / 16)
and ``index_topk`` (6) are small so that prompts of a few hundred tokens already span many
windows, compressed entries and 128-token KV blocks. transformers initialises some parameters to
zero (sinks, position biases, mHC biases, the hash table); :func:`randomise_zero_initialised`
draws them, so a mistake in how they are used changes the output.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Any, Mapping

import torch

__all__ = ["TINY_V4_KWARGS", "randomise_zero_initialised", "save_tiny_v4", "tiny_v4_config"]


TINY_V4_KWARGS: Mapping[str, Any] = MappingProxyType(
    dict(
        vocab_size=320,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        partial_rotary_factor=0.25,
        num_experts_per_tok=2,
        n_routed_experts=8,
        routed_scaling_factor=1.5,
        swiglu_limit=0.5,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        hc_mult=3,
        hc_sinkhorn_iters=6,
        sliding_window=16,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=6,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=1,
    )
)  # fmt: skip  (read-only: tiny_v4_config(**overrides) copies it)


def tiny_v4_config(**overrides: Any):
    """``transformers.DeepseekV4Config`` of the tiny model; ``overrides`` replace fields (a
    longer context: ``max_position_embeddings`` with a matching yarn original length)."""
    import transformers

    return transformers.DeepseekV4Config(**(dict(TINY_V4_KWARGS) | overrides))


def randomise_zero_initialised(model: torch.nn.Module, seed: int) -> None:
    """Draw the parameters and buffers transformers initialises to zero or identity (attention
    sinks, compressor position biases, hyper-connection bases, the hash-routing table, the router
    bias): in a real checkpoint they carry information, so a test must see them used."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, model.config.n_routed_experts, b.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def save_tiny_v4(path: str | os.PathLike, seed: int, randomise_seed: int, config=None):
    """Build transformers' tiny V4 (``config``, default :func:`tiny_v4_config`) from ``seed``, draw
    its zero-initialised parameters from ``randomise_seed``, save it to ``path`` and return the
    model in eval mode, with ``eos_token_id`` cleared so its ``generate`` runs full length."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config if config is not None else tiny_v4_config()).eval()
    randomise_zero_initialised(model, randomise_seed)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None
    return model

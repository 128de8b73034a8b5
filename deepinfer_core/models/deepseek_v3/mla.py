"""DeepSeek-V2/V3 multi-head latent attention (MLA), run in the absorbed form.

Hugging Face decompresses the cached latent into per-head keys and values
(``kv_b_proj``) on every step. We instead cache, per token, one shared "key" of width
``kv_lora_rank + rope_dim``::

    cache entry  [ c_kv (normalised latent, kv_lora_rank) | k_pe (roped, rope_dim) ]

and move the up-projections to the query and output sides, which is the same arithmetic
re-associated:

    score(h)  = q_nope[h] . (W_UK[h] c_kv) + q_pe[h] . k_pe
              = (W_UK[h]^T q_nope[h]) . c_kv + q_pe[h] . k_pe      <- absorbed query
    out(h)    = W_UV[h] (sum_s p_s c_kv[s])                          <- latent output, then W_UV

so the attention backend sees an MQA layer with one KV head whose values are the first
``kv_lora_rank`` channels of the key (``AttentionKind.MLA``, ``kv_shared=True``). The cache is
``kv_lora_rank + rope_dim`` floats per token instead of ``H * (qk_head_dim + v_head_dim)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ...attention import AttentionBackend, AttentionKind, AttentionLayerSpec, AttentionMetadata
from ..layers import RMSNorm, Rotary, plain_linear, project, rope_inv_freq, yarn_get_mscale, yarn_rope_inv_freq

if TYPE_CHECKING:
    from ...fused_ops import FusedOps


def rope_parameters(config: dict) -> dict:
    """The rope dict of a DeepSeek config, whichever spelling wrote it.

    transformers 5 writes ``rope_parameters`` (with ``rope_theta`` inside); original DeepSeek
    checkpoints write ``rope_scaling`` (``type: yarn``) and a top-level ``rope_theta``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


def build_rotary(config: dict, device: torch.device) -> Rotary:
    """Rotary tables for the ``qk_rope_head_dim`` channels (default or YaRN)."""
    params = rope_parameters(config)
    dim, theta = config["qk_rope_head_dim"], params["rope_theta"]
    if params["rope_type"] == "yarn":
        inv_freq, attn_scale = yarn_rope_inv_freq(dim, theta, params, config["max_position_embeddings"])
    else:
        inv_freq, attn_scale = rope_inv_freq(dim, theta, params)
    return Rotary(dim, config["max_position_embeddings"], inv_freq, attn_scale).to(device)


def softmax_scale(config: dict) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when set:
    DeepSeek folds the long-context magnitude correction into the softmax scale."""
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


def mla_spec(config: dict, layer_index: int, kv_dtype: torch.dtype) -> AttentionLayerSpec:
    latent, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    return AttentionLayerSpec(
        kind=AttentionKind.MLA,
        layer_index=layer_index,
        num_heads=config["num_attention_heads"],
        num_kv_heads=1,
        head_dim=latent + rope,
        v_head_dim=latent,
        scale=softmax_scale(config),
        rope_dim=rope,
        kv_shared=True,
        kv_dtype=kv_dtype,
    )


class MLAAttention(nn.Module):
    """One MLA layer; parameter names follow Hugging Face (``self_attn.*``) so weights load
    by name. ``kv_b_proj`` is kept whole and viewed as W_UK / W_UV at run time (no second copy)."""

    def __init__(self, config: dict, spec: AttentionLayerSpec, backend: AttentionBackend) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.nope_dim = config["qk_nope_head_dim"]
        self.rope_dim = config["qk_rope_head_dim"]
        self.v_dim = config["v_head_dim"]
        self.latent_dim = config["kv_lora_rank"]
        self.q_lora_rank = config.get("q_lora_rank")
        self.interleaved_rope = bool(config.get("rope_interleave", True))
        self.spec, self.backend = spec, backend
        bias = bool(config.get("attention_bias", False))
        qk_dim = self.nope_dim + self.rope_dim
        eps = config.get("rms_norm_eps", 1e-6)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, eps)
        self.kv_b_proj = nn.Linear(self.latent_dim, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)

    rope_cat = None  # a platform's fused rotary + concatenation (deepinfer_core.fused_ops)
    norm_rope_cat = None  # FusedOps.norm_rope_cat: the key's kv_a norm + rope + concatenation in one kernel
    linear = None  # a platform's FusedOps.dense_linear for the plain projections (fused_ops.install)
    head_linear = None  # FusedOps.head_linear for the absorbed W_UK / W_UV products
    qkv_a_weight = None  # q_a's and kv_a's weights as one tensor (fused_ops.install, with linear)

    def use_fused_ops(self, ops: FusedOps) -> bool:
        """Take ``ops.dense_linear`` / ``head_linear`` for the plain projections (then, for 16-bit
        bias-free q_a and kv_a, the two weights move into one tensor: the parameters become views
        of it, no second copy) and the fused rotary + concatenation; ``fused_ops.install`` calls it."""
        if ops.dense_linear is not None:
            self.linear, self.head_linear = ops.dense_linear, ops.head_linear
            qa, kva = getattr(self, "q_a_proj", None), self.kv_a_proj_with_mqa
            if (
                plain_linear(qa)
                and plain_linear(kva)
                and qa.weight.dtype == kva.weight.dtype
                and qa.weight.dtype in (torch.bfloat16, torch.float16)
                and qa.weight.device == kva.weight.device
            ):
                both = torch.cat([qa.weight.data, kva.weight.data])
                qa.weight.data, kva.weight.data = both[: qa.out_features], both[qa.out_features :]
                self.qkv_a_weight = both
        if ops.rope_cat is not None:
            self.rope_cat = ops.rope_cat
            self.norm_rope_cat = (
                ops.norm_rope_cat if ops.rms_norm is not None else None
            )  # only where the norm is fused anyway
        return ops.dense_linear is not None or ops.rope_cat is not None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        # DeepSeek's checkpoints pair rope channels as (0,1),(2,3),...; putting evens before
        # odds turns that into the rotate-half layout Rotary implements. q and k get the same
        # permutation, so their dot product is unchanged.
        if self.interleaved_rope:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return rotary(x, positions)

    def _assemble(self, head: torch.Tensor, pe: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """``cat([head, rope(pe)])`` ([T, h, d] and [T, h, r] -> [T, h, d + r]): queries and cache
        entries, through a platform's fused kernel when it has one (deepinfer_core.fused_ops)."""
        if self.rope_cat is not None:
            return self.rope_cat(head, pe, positions, rotary.cos, rotary.sin, self.interleaved_rope)
        return torch.cat([head, self._rope(pe, positions, rotary)], dim=-1)

    def _key(self, kv_a: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """The cache entry ``cat([norm(kv_a[:, :C]), rope(kv_a[:, C:])])`` [T, 1, C + r]: one
        kernel where the platform fuses the norm into the key's rope (a 1-request decode step is
        bound by its ~150 small launches), else the norm and :meth:`_assemble`."""
        T, C = kv_a.shape[0], self.latent_dim
        k_pe = kv_a[:, C:].view(T, 1, self.rope_dim)  # [T, 1, r]
        norm = self.kv_a_layernorm
        fused = self.norm_rope_cat
        if (
            fused is not None
            and type(norm) is RMSNorm
            and norm.fused is not None
            and norm.weight.dtype == kv_a.dtype
            and self.rope_cat is not None
        ):
            return fused(
                kv_a[:, :C], norm.weight, norm.eps, k_pe, positions, rotary.cos, rotary.sin, self.interleaved_rope
            )
        return self._assemble(norm(kv_a[:, :C])[:, None, :], k_pe, positions, rotary)

    def forward(
        self,
        x: torch.Tensor,  # [T, D] normalised hidden states
        positions: torch.Tensor,  # [T]
        rotary: Rotary,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, D]
        T = x.shape[0]
        H, C = self.num_heads, self.latent_dim
        lin = self.linear
        if self.q_lora_rank is None:
            q, kv_a = project(lin, self.q_proj, x), project(lin, self.kv_a_proj_with_mqa, x)
        else:
            if self.qkv_a_weight is not None and lin is not None:  # one launch for both (same input)
                q_a, kv_a = lin(x, self.qkv_a_weight).split([self.q_lora_rank, self.latent_dim + self.rope_dim], dim=-1)
            else:
                q_a, kv_a = project(lin, self.q_a_proj, x), project(lin, self.kv_a_proj_with_mqa, x)
            if (
                lin is not None and plain_linear(self.q_b_proj) and type(self.q_a_layernorm) is RMSNorm
            ):  # the norm inside q_b's launch
                q = lin(q_a, self.q_b_proj.weight, norm=(self.q_a_layernorm.weight, self.q_a_layernorm.eps))
            else:
                q = project(lin, self.q_b_proj, self.q_a_layernorm(q_a))
        q = q.view(T, H, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [T, H, n], [T, H, r]
        key = self._key(kv_a, positions, rotary)  # kv_a [T, C + r] -> [T, 1, C + r]

        w_kv = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, C)
        expand = getattr(self.backend, "expand_mla", None)
        if expand is not None and expand(self.spec, meta):  # the backend's non-absorbed form (prefill)
            out = self.backend.forward_mla_expanded(
                self.spec, self._assemble(q_nope, q_pe, positions, rotary), key, w_kv, kv_cache, meta
            )
            return project(lin, self.o_proj, out.reshape(T, H * self.v_dim))
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim :]  # [H, n, C], [H, v, C]
        if self.head_linear is not None:
            q_latent = self.head_linear(q_nope, w_uk.transpose(1, 2))
        else:
            q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, H, C]
        query = self._assemble(q_latent, q_pe, positions, rotary)  # [T, H, C + r]

        out_latent = self.backend.forward(self.spec, query, key, None, kv_cache, meta)  # [T, H, C]
        if self.head_linear is not None:
            out = self.head_linear(out_latent, w_uv)
        else:
            out = torch.einsum("thc,hvc->thv", out_latent, w_uv)  # [T, H, v]
        return project(lin, self.o_proj, out.reshape(T, H * self.v_dim))

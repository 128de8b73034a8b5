"""Llama-architecture causal LM (Llama 2/3, Mistral-style GQA, SmolLM2, Qwen2/Qwen2.5) on a flat token batch.

Parameter names equal Hugging Face's (``model.layers.N.self_attn.q_proj.weight`` ...), so the
GGUF and safetensors loaders feed the same ``load_weights``. Attention goes through the backend
the context resolves for each layer's :class:`AttentionLayerSpec`; this module never picks a
kernel. One forward serves any mix of prefill and decode tokens of many requests::

    input_ids [T] -> embed [T, D] -> N x (norm -> attn(+rope, paged KV) -> +res -> norm -> MLP -> +res)
              -> norm -> hidden [T, D]        compute_logits: [N, D] -> [N, V] float32
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...attention import AttentionBackend, AttentionKind, AttentionLayerSpec, AttentionMetadata
from .. import ModelContext, WeightsError
from ..fast_init import allocate
from ..layers import FusedLinear, GatedMLP, PreNormDecoderLayer, RMSNorm, Rotary, RotaryAt, fused_targets, rope_inv_freq

# Buffers some checkpoints save that we recompute ourselves.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def rope_settings(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the classic keys or transformers 5's ``rope_parameters``."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = config.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return float(theta), scaling


def attention_biases(config: dict) -> tuple[bool, bool]:
    """(q/k/v projections have a bias, o_proj has one). Llama's ``attention_bias`` sets both;
    Qwen2 (``model_type`` qwen2) has q/k/v biases and no o bias, and its configs carry no key for
    it. ``o_proj_bias`` (written by the GGUF loader, from the file's tensors) overrides the o part."""
    qwen2 = config.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in (config.get("architectures") or ())
    qkv = bool(config.get("attention_bias", qwen2))
    return qkv, bool(config.get("o_proj_bias", False if qwen2 else qkv))


class LlamaAttention(nn.Module):
    def __init__(self, config: dict, spec: AttentionLayerSpec, backend: AttentionBackend) -> None:
        super().__init__()
        hidden, (qkv_bias, o_bias) = config["hidden_size"], attention_biases(config)
        self.spec, self.backend = spec, backend
        q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = FusedLinear(hidden, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}, bias=qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, hidden, bias=o_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary | RotaryAt,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # x [T, D] -> [T, D]
        s, T = self.spec, x.shape[0]
        if isinstance(rotary, Rotary):
            rotary = rotary.at(positions, x.dtype)
        qkv = self.qkv_proj(x)  # [T, q | k | v]
        heads, qk_rows = s.num_heads + s.num_kv_heads, (s.num_heads + s.num_kv_heads) * s.head_dim
        qk = rotary(qkv[:, :qk_rows].reshape(T, heads, s.head_dim))  # q and k rotated together
        q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]  # [T, H, hd], [T, Hkv, hd]
        v = qkv[:, qk_rows:].reshape(T, s.num_kv_heads, s.head_dim)  # [T, Hkv, hd]
        out = self.backend.forward(s, q, k, v, kv_cache, meta)  # [T, H, hd]
        return self.o_proj(out.reshape(T, s.num_heads * s.head_dim))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, spec: AttentionLayerSpec, backend: AttentionBackend) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, spec, backend)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config["intermediate_size"], bias=bool(config.get("mlp_bias", False)))


class LlamaModel(nn.Module):
    """The decoder stack; a submodule named ``model`` so parameter names match Hugging Face."""

    def __init__(self, config: dict, specs: list[AttentionLayerSpec], backends: list[AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, s, b) for s, b in zip(specs, backends))
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))


class LlamaForCausalLM(nn.Module):
    """Implements :class:`deepinfer_core.models.CausalLM`."""

    # Its attention reads only the paged cache: a speculative verify step runs as decode rows, one
    # per token (engine/batch_build.build), on the decode kernels and their captured graphs.
    verify_as_decode_rows = True

    def __init__(self, config: dict, ctx: ModelContext) -> None:
        super().__init__()
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"Llama with hidden_act={config['hidden_act']!r} is not supported")
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("Llama with partial rotary embeddings is not supported")
        if config.get("use_sliding_window"):  # Qwen2 configs: off in every released Qwen2/2.5 model
            raise NotImplementedError("Qwen2 with use_sliding_window=True is not supported")
        self.config = config
        self.vocab_size = int(config["vocab_size"])
        self.max_position_embeddings = int(config.get("max_position_embeddings", 2048))
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        self.attention_specs = [
            AttentionLayerSpec(
                kind=AttentionKind.FULL,
                layer_index=i,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                v_head_dim=head_dim,
                scale=head_dim**-0.5,
                kv_dtype=ctx.kv_dtype or ctx.dtype,
            )
            for i in range(int(config["num_hidden_layers"]))
        ]
        backends = [ctx.attention_backend(spec) for spec in self.attention_specs]
        theta, scaling = rope_settings(config)
        inv_freq, attn_scaling = rope_inv_freq(
            head_dim, theta, scaling, self.max_position_embeddings
        )  # fails early on unknown rope types

        # Parameters are created without memory and then allocated uninitialised on the target
        # device: load_weights overwrites every one of them (and fails if any is missing).
        with torch.device("meta"):
            self.model = LlamaModel(config, self.attention_specs, backends)
            self.lm_head = (
                None if self.tie_word_embeddings else nn.Linear(config["hidden_size"], self.vocab_size, bias=False)
            )
        self.to(ctx.dtype)  # on the meta device: nothing is allocated in float32 first
        allocate(self, ctx)  # = self.to_empty(device=ctx.device), without importing sympy
        self.rotary = Rotary(head_dim, self.max_position_embeddings, inv_freq.to(ctx.device), attn_scaling).to(
            ctx.device
        )

    # A whole step in one call (FusedDecodeStep), installed by the engine through
    # deepinfer_fused_decode_step (the low-bit CPU path: one native call per step); None: the layers below.
    fused_step = None

    # -- forward -----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, D]
        if self.fused_step is not None and (hidden := self.fused_step.run(input_ids, kv_caches, meta)) is not None:
            return hidden
        h = self.model.embed_tokens(input_ids)  # [T, D]
        rotary = self.rotary.at(positions, h.dtype)  # looked up once for all layers
        meta = dataclasses.replace(meta, scratch={})  # backends share per-step work across layers
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer.forward_residual(h, residual, positions, rotary, kv_cache, meta)
        return self.model.norm(h) if residual is None else self.model.norm.add_forward(h, residual)[0]

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` ([T, D], after the final norm) and the last layer's output before that
        norm ([T, D]): what a drafter that reads the target's hidden state consumes. A fused
        step that offers ``run_hidden`` (the low-bit native plan) answers it; else the layers run."""
        run_hidden = getattr(self.fused_step, "run_hidden", None)
        if run_hidden is not None and (got := run_hidden(input_ids, kv_caches, meta)) is not None:
            return got
        h = self.model.embed_tokens(input_ids)
        rotary = self.rotary.at(positions, h.dtype)
        meta = dataclasses.replace(meta, scratch={})
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer.forward_residual(h, residual, positions, rotary, kv_cache, meta)
        return (self.model.norm(h), h) if residual is None else self.model.norm.add_forward(h, residual)

    logits_kernel = None  # FusedOps.logits: a 16-bit LM head with float32 output (fused_ops.install)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] float32
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if hasattr(head, "project"):  # a weight format's module (packed weights): its own kernels
            return head.project(hidden).float()
        if self.logits_kernel is not None and hidden.dtype != torch.float32 and hidden.dtype == head.weight.dtype:
            return self.logits_kernel(hidden, head.weight)
        return F.linear(hidden, head.weight).float()

    fused_greedy = True  # greedy_tokens may answer (benchmarks turn it off for side-by-side runs)

    def greedy_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int] | None:  # [N, D] -> ([N] int64, vocab)
        """``torch.argmax(compute_logits(hidden), -1)`` and the vocabulary size, without the
        [N, V] logits, from a head module that offers ``greedy_argmax`` (a weight format's:
        the low-bit head's kernel, the same bits, ties to the lowest index); None where it does
        not apply (a float head, a NaN logit): the caller computes the logits."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        greedy = getattr(head, "greedy_argmax", None)
        if not self.fused_greedy or greedy is None or hidden.device.type != "cpu":
            return None
        chooser = getattr(self.fused_step, "threads", None)
        most = torch.get_num_threads()
        threads = min(chooser.current or most, most) if chooser is not None else most  # the fused step's count
        return greedy(hidden, threads, self.screened_head)

    screened_head = True  # greedy_argmax may screen a q8 head in int8 (lowbit/head_screen.c; benchmarks turn it off)

    # -- weights -----------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, tensor)`` pairs in; report every problem at once in a WeightsError."""
        fused, fused_params = fused_targets(self)
        params = {n: p for n, p in self.named_parameters() if n not in fused_params} | fused
        loaded: set[str] = set()
        unexpected: list[str] = []
        misshaped: list[str] = []
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                # A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
                if not (name == "lm_head.weight" and self.tie_word_embeddings) and not name.endswith(_IGNORED_SUFFIXES):
                    unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                misshaped.append(f"{name} {tuple(tensor.shape)} (expected {tuple(param.shape)})")
                continue
            if isinstance(param, torch.Tensor):
                param.copy_(tensor)
            else:  # a weight format's slot keeps the packed tensor
                param.fill(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing or unexpected or misshaped:
            parts = [
                f"{label}: {_names(items)}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
                if items
            ]
            raise WeightsError("Llama weights do not match the config; " + "; ".join(parts))


def _names(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} ... ({len(items)} in all)"


def build(config: dict, ctx: ModelContext) -> LlamaForCausalLM:
    """ModelFactory registered for ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` (the Llama
    layout with q/k/v biases: :func:`attention_biases`)."""
    return LlamaForCausalLM(config, ctx)

"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA attention + sigmoid-routed MoE with shared experts.

Multi-token prediction: a checkpoint whose config has ``num_nextn_predict_layers = k`` carries
``k`` MTP modules as layers ``num_hidden_layers ..`` (transformers skips them). Each is a full
decoder layer with its own input mixing and head norm, sharing the embedding and LM head::

    x      = eh_proj(cat(enorm(embed(token at p + 1)), hnorm(hidden at p)))      [T, D]
    out    = decoder_layer(x)           roped at p, with its own paged KV cache
    logits = lm_head(shared_head.norm(out))                                      (token at p + 2)

``hidden`` is the main model's last layer output before the final norm (``forward_hidden``'s
second result); ``out`` feeds the next link when drafts are chained. Loaded here as ``mtp.N.*``
(the checkpoint's ``model.layers.{n + N}.*``; its copies of ``embed_tokens`` and
``shared_head.head`` are the main model's and are skipped), it drafts for speculative decoding
(``speculative_config={"method": "mtp"}``); a checkpoint without the tensors loads and cannot draft.

Layer ``i`` is MoE when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0`` (original
DeepSeek configs; transformers' configs omit the frequency, which means 1), otherwise a dense
SwiGLU MLP. Attention is in ``deepseek_v3_mla``; routing and expert compute go through the
context's MoE dispatcher; weights arrive under Hugging Face names (``models.hf_weights``).
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...attention import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from ...moe import ExpertWeights, MoEDispatcher, MoESpec
from .. import ModelContext
from ..fast_init import allocate
from ..hf_weights import load_hf_weights
from ..layers import GatedMLP, PreNormDecoderLayer, RMSNorm, StackedExperts
from ..shared_expert import SharedExpertFold
from .mla import MLAAttention, build_rotary, mla_spec


def is_moe_layer(config: dict, index: int) -> bool:
    if not config.get("n_routed_experts"):
        return False
    freq = config.get("moe_layer_freq") or 1
    return index >= (config.get("first_k_dense_replace") or 0) and index % freq == 0


def moe_spec(config: dict, index: int) -> MoESpec:
    return MoESpec(
        layer_index=index,
        num_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["moe_intermediate_size"],
        scoring="sigmoid",
        num_groups=config.get("n_group") or 1,
        topk_groups=config.get("topk_group") or 1,
        normalize_topk=bool(config.get("norm_topk_prob", True)),
        routed_scaling=float(config.get("routed_scaling_factor", 1.0)),
        num_shared_experts=config.get("n_shared_experts") or 0,
    )


class Router(nn.Module):
    """Router parameters (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``); the
    bias shifts which experts are chosen but not their weights (DeepSeek's aux-loss-free
    balancing), so it is passed to the dispatcher separately. Kept in float32 like the
    reference, because top-k choices are sensitive to rounding."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))


class DeepseekV3MoE(SharedExpertFold, nn.Module):
    def __init__(self, config: dict, spec: MoESpec, dispatcher: MoEDispatcher) -> None:
        super().__init__()
        self.spec, self.dispatcher = spec, dispatcher
        self.gate = Router(spec.num_experts, spec.hidden_size)
        self.experts = StackedExperts(spec)
        self.shared_experts = (
            GatedMLP(spec.hidden_size, spec.intermediate_size * spec.num_shared_experts)
            if spec.num_shared_experts
            else None
        )
        self.expert_load = None  # ModelContext.expert_load, set by the model once built

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        router = getattr(self.dispatcher, "router_logits", None)  # optional (TorchMoEDispatcher's)
        logits = (
            router(x, self.gate.weight) if router else F.linear(x.float(), self.gate.weight.float())
        )  # [T, E] float32
        ids, weights = self.dispatcher.select_experts(self.spec, logits, self.gate.e_score_correction_bias)
        if self.expert_load is not None:
            self.expert_load.record(self.spec.layer_index, ids)
        experts = ExpertWeights(
            gate_up=self.experts.gate_up_proj, down=self.experts.down_proj,  # FP8 experts (models.fp8) add scales
            gate_up_scale=getattr(self.experts, "gate_up_scale", None),
            down_scale=getattr(self.experts, "down_scale", None),
        )  # fmt: skip
        out = self.forward_folded(x, ids, weights, experts)  # optional: the shared expert folded in
        if out is not None:
            return out
        out = self.dispatcher.forward(self.spec, x, ids, weights, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class LayerKernels(NamedTuple):
    """The attention backend and (for MoE layers) dispatcher one layer runs on. Resolved
    before the modules are built on the meta device, so a backend that allocates workspace
    in its constructor gets real memory."""

    attn_spec: AttentionLayerSpec
    attention: AttentionBackend
    moe: tuple[MoESpec, MoEDispatcher] | None


def layer_kernels(config: dict, ctx: ModelContext, i: int) -> LayerKernels:
    spec = mla_spec(config, i, ctx.dtype)
    mspec = moe_spec(config, i) if is_moe_layer(config, i) else None
    moe = (mspec, ctx.moe_dispatcher(mspec)) if mspec is not None else None
    return LayerKernels(spec, ctx.attention_backend(spec), moe)


def resolve_kernels(config: dict, ctx: ModelContext) -> list[LayerKernels]:
    return [layer_kernels(config, ctx, i) for i in range(config["num_hidden_layers"])]


class MTPCacheLayout(NamedTuple):
    """The MTP layers' paged caches: ``allocate(num_blocks, rows, device)`` gives one tensor per
    layer (``rows`` is unused: MLA keeps no per-request state)."""

    layers: tuple[tuple[AttentionBackend, AttentionLayerSpec], ...]
    block_size: int

    def allocate(self, num_blocks: int, rows: int, device) -> list[torch.Tensor]:
        return [
            torch.zeros(backend.kv_cache_shape(spec, num_blocks, self.block_size), dtype=spec.kv_dtype, device=device)
            for backend, spec in self.layers
        ]


_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the main model's


def mtp_renamed(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int):
    """``model.layers.{num_layers + N}.X`` -> ``mtp.N.X``; the MTP layers' copies of the
    embedding and LM head are dropped (the main model's are used)."""
    for name, tensor in weights:
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
        if m and int(m.group(1)) >= num_layers:
            if m.group(2) in _MTP_SHARED:
                continue
            name = f"mtp.{int(m.group(1)) - num_layers}.{m.group(2)}"
        yield name, tensor


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: dict, kernels: LayerKernels) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = MLAAttention(config, kernels.attn_spec, kernels.attention)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        if kernels.moe is not None:
            self.mlp: nn.Module = DeepseekV3MoE(config, *kernels.moe)
        else:
            self.mlp = GatedMLP(config["hidden_size"], config["intermediate_size"])


class MTPLayer(DecoderLayer):
    """One MTP module: a decoder layer plus ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm`` (names as in DeepSeek's checkpoints, under ``mtp.N.``)."""

    def __init__(self, config: dict, kernels: LayerKernels) -> None:
        super().__init__(config, kernels)
        d, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, eps)

    def draft(self, hidden, embeds, positions, rotary, cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed hidden for the shared LM head, pre-norm output for the next link), both [T, D]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        h, residual = self.forward_residual(x, None, positions, rotary, cache, meta)
        out = h + residual
        return self.shared_head.norm(out), out


NO_MTP_IN_CONFIG = "the config has num_nextn_predict_layers = 0"
NO_MTP_IN_CHECKPOINT = "the checkpoint has no MTP layer tensors (a checkpoint without them loads, but cannot draft)"


class Backbone(nn.Module):
    """``model.*`` in Hugging Face naming."""

    def __init__(self, config: dict, kernels: list[LayerKernels]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(config, k) for k in kernels)
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))


class DeepseekV3ForCausalLM(nn.Module):
    """Implements :class:`~deepinfer_core.models.CausalLM` on a flat token batch."""

    def __init__(self, config: dict, ctx: ModelContext) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config["vocab_size"]
        self.max_position_embeddings = config["max_position_embeddings"]
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        # Built on the meta device so a large model is not randomly initialised first only to
        # be overwritten by load_weights (which insists on every tensor being present).
        kernels = resolve_kernels(config, ctx)
        n, k = config["num_hidden_layers"], int(config.get("num_nextn_predict_layers") or 0)
        mtp_kernels = [layer_kernels(config, ctx, i) for i in range(n, n + k)]
        with torch.device("meta"):
            self.model = Backbone(config, kernels)
            self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
            self.mtp = nn.ModuleList(MTPLayer(config, kk) for kk in mtp_kernels) if mtp_kernels else None
        self.mtp_unavailable = None if mtp_kernels else NO_MTP_IN_CONFIG  # why mtp_forward cannot run
        self.mtp_attention_specs = [kk.attn_spec for kk in mtp_kernels]
        # cast on the meta device, then allocate: materialising first held the model in float32
        self.to(dtype=ctx.dtype)
        self.restore_float32()
        allocate(self, ctx)  # packed modules swapped in, then = self.to_empty(device=ctx.device)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = build_rotary(config, ctx.device)  # shared by all layers, not a weight
        self.attention_specs = [layer.self_attn.spec for layer in self.model.layers]
        self.requires_grad_(False)
        if ctx.expert_load is not None:
            for layer in self.model.layers:
                if isinstance(layer.mlp, DeepseekV3MoE):
                    ctx.expert_load.add_layer(layer.mlp.spec.layer_index, layer.mlp.spec.num_experts)
                    layer.mlp.expert_load = ctx.expert_load

    def _all_layers(self) -> list[DecoderLayer]:
        return [*self.model.layers, *(self.mtp or ())]

    def restore_float32(self) -> None:
        """The router (weight and correction bias) in float32 whatever the model dtype, as
        transformers keeps it (``_keep_in_fp32_modules_strict``); called again after any cast,
        which also re-derives each MoE layer's shared-expert views (a cast may move the weights)."""
        for layer in self._all_layers():
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp.gate.float()
                layer.mlp.bind_shared()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.mtp is None:
            load_hf_weights(self, weights)  # MTP layers in the checkpoint are skipped
        else:
            loaded = load_hf_weights(
                self, mtp_renamed(weights, self.config["num_hidden_layers"]), optional_prefix="mtp."
            )
            if not any(name.startswith("mtp.") for name in loaded):
                self.mtp = None  # the checkpoint has no MTP layer: free its memory, drafting unavailable
                self.mtp_unavailable = NO_MTP_IN_CHECKPOINT
                self.mtp_attention_specs = []
        for layer in self._all_layers():
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp.bind_shared()

    def mtp_kv_layout(self, block_size: int, num_speculative_tokens: int = 0) -> "MTPCacheLayout":
        """Cache layout of the MTP layers (one paged cache per layer), allocated by the drafter."""
        if self.mtp is None:
            raise RuntimeError(f"DeepSeek-V3 MTP drafting is unavailable: {self.mtp_unavailable}")
        backends = [layer.self_attn.backend for layer in self.mtp]
        return MTPCacheLayout(tuple(zip(backends, self.mtp_attention_specs)), block_size)

    def mtp_forward(
        self,
        hidden: torch.Tensor,
        next_token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        block: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits with MTP layer ``block``: ``hidden`` [T, D] is the pre-norm hidden state at
        ``positions`` (``forward_hidden``'s second result, or a previous call's output when
        chaining), ``next_token_ids`` [T] the tokens at ``positions + 1``; ``cache`` is this
        layer's (:meth:`mtp_kv_layout`), ``meta`` laid out as for :meth:`forward`. Returns
        ``(logits [T, V] float32 for positions + 2, pre-norm output [T, D])``."""
        if self.mtp is None:
            raise RuntimeError(f"DeepSeek-V3 MTP drafting is unavailable: {self.mtp_unavailable}")
        if not 0 <= block < len(self.mtp):
            raise ValueError(
                f"MTP layer {block} does not exist; this model has {len(self.mtp)} (num_nextn_predict_layers)"
            )
        T, d = hidden.shape[0], self.config["hidden_size"]
        if hidden.shape != (T, d) or next_token_ids.shape != (T,):
            raise ValueError(
                f"mtp_forward: hidden must be [T, hidden_size={d}] and next_token_ids [T]; got "
                f"{tuple(hidden.shape)} and {tuple(next_token_ids.shape)}"
            )
        embeds = self.model.embed_tokens(next_token_ids)
        normed, out = self.mtp[block].draft(hidden, embeds, positions, self.rotary, cache, meta)
        return self.compute_logits(normed), out

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, D]
        h = self.model.embed_tokens(input_ids)
        residual = None
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer.forward_residual(h, residual, positions, self.rotary, cache, meta)
        return self.model.norm(h) if residual is None else self.model.norm.add_forward(h, residual)[0]

    def forward_hidden(self, input_ids, positions, kv_caches, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` and the last layer's output before the final norm (both [T, D])."""
        h = self.model.embed_tokens(input_ids)
        residual = None
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer.forward_residual(h, residual, positions, self.rotary, cache, meta)
        return (self.model.norm(h), h) if residual is None else self.model.norm.add_forward(h, residual)

    logits_kernel = None  # FusedOps.logits: a 16-bit LM head with float32 output (fused_ops.install)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V]
        w = self.lm_head.weight
        if self.logits_kernel is not None and hidden.dtype != torch.float32 and hidden.dtype == w.dtype:
            return self.logits_kernel(hidden, w)
        return self.lm_head(hidden).float()


def build(config: dict, ctx: ModelContext) -> DeepseekV3ForCausalLM:
    """Model factory registered for ``DeepseekV3ForCausalLM``."""
    return DeepseekV3ForCausalLM(config, ctx)

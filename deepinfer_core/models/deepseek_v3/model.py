"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA attention + sigmoid-routed MoE with shared experts.

Layer ``i`` is MoE when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0`` (original
DeepSeek configs; transformers' configs omit the frequency, which means 1), otherwise a dense
SwiGLU MLP. Attention is in ``deepseek_v3_mla``; routing and expert compute go through the
context's MoE dispatcher; weights arrive under Hugging Face names (``models.hf_weights``).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...attention import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from ...moe import ExpertWeights, MoEDispatcher, MoESpec
from .. import ModelContext
from ..fast_init import materialize
from ..hf_weights import load_hf_weights
from ..layers import FusedLinear, GatedMLP, PreNormDecoderLayer, RMSNorm, StackedExperts
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


class DeepseekV3MoE(nn.Module):
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
        self._shared: tuple[ExpertWeights | None] | None = None  # (shared_weights(),) once derived

    def bind_shared(self) -> None:
        """Derive :meth:`shared_weights` once the weights are in place (``load_weights`` calls
        it), instead of rebuilding its views on every forward; call it again after replacing the
        shared expert's weights (its views would still read the old ones)."""
        self._shared = (self.shared_weights(),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        router = getattr(self.dispatcher, "router_logits", None)  # optional (TorchMoEDispatcher's)
        logits = (
            router(x, self.gate.weight) if router else F.linear(x.float(), self.gate.weight.float())
        )  # [T, E] float32
        ids, weights = self.dispatcher.select_experts(self.spec, logits, self.gate.e_score_correction_bias)
        experts = ExpertWeights(
            gate_up=self.experts.gate_up_proj, down=self.experts.down_proj,  # FP8 experts (models.fp8) add scales
            gate_up_scale=getattr(self.experts, "gate_up_scale", None),
            down_scale=getattr(self.experts, "down_scale", None),
        )  # fmt: skip
        both = getattr(self.dispatcher, "forward_with_shared", None)  # optional: the shared expert folded in
        if both is not None and self._shared is None:  # a layer used without load_weights
            self.bind_shared()
        shared = self._shared[0] if both is not None else None
        out = both(self.spec, x, ids, weights, experts, shared) if shared is not None else None
        if out is not None:
            return out
        out = self.dispatcher.forward(self.spec, x, ids, weights, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def shared_weights(self) -> ExpertWeights | None:
        """The shared expert as a one-expert stack (views of its weights, FP8 with scales), for a
        dispatcher's ``forward_with_shared``; None without one or where its projections are not
        plain bias-free linears (e.g. packed low-bit modules)."""
        from ..fp8 import Fp8Linear

        mlp = self.shared_experts
        if mlp is None:
            return None
        gu, dn = mlp.gate_up_proj, mlp.down_proj
        if isinstance(gu, Fp8Linear) and isinstance(dn, Fp8Linear):
            return ExpertWeights(gu.weight_fp8[None], dn.weight_fp8[None], gu.scale_inv[None], dn.scale_inv[None])
        w1, w2 = getattr(gu, "weight", None), getattr(dn, "weight", None)
        plain = type(gu).forward is FusedLinear.forward and type(dn).forward is nn.Linear.forward
        if (
            plain
            and isinstance(w1, torch.Tensor)
            and isinstance(w2, torch.Tensor)
            and gu.bias is None
            and dn.bias is None
        ):
            return ExpertWeights(w1[None], w2[None])
        return None


class LayerKernels(NamedTuple):
    """The attention backend and (for MoE layers) dispatcher one layer runs on. Resolved
    before the modules are built on the meta device, so a backend that allocates workspace
    in its constructor gets real memory."""

    attn_spec: AttentionLayerSpec
    attention: AttentionBackend
    moe: tuple[MoESpec, MoEDispatcher] | None


def resolve_kernels(config: dict, ctx: ModelContext) -> list[LayerKernels]:
    kernels = []
    for i in range(config["num_hidden_layers"]):
        spec = mla_spec(config, i, ctx.dtype)
        mspec = moe_spec(config, i) if is_moe_layer(config, i) else None
        moe = (mspec, ctx.moe_dispatcher(mspec)) if mspec is not None else None
        kernels.append(LayerKernels(spec, ctx.attention_backend(spec), moe))
    return kernels


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
        with torch.device("meta"):
            self.model = Backbone(config, kernels)
            self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        materialize(self, ctx.device)  # = self.to_empty(device=ctx.device), without importing sympy
        self.to(dtype=ctx.dtype)
        self.restore_float32()
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = build_rotary(config, ctx.device)  # shared by all layers, not a weight
        self.attention_specs = [layer.self_attn.spec for layer in self.model.layers]
        self.requires_grad_(False)

    def restore_float32(self) -> None:
        """The router (weight and correction bias) in float32 whatever the model dtype, as
        transformers keeps it (``_keep_in_fp32_modules_strict``); called again after any cast,
        which also re-derives each MoE layer's shared-expert views (a cast may move the weights)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp.gate.float()
                layer.mlp.bind_shared()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_hf_weights(self, weights)
        for layer in self.model.layers:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp.bind_shared()

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

"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): shared-K=V MQA with sliding window, compressed sparse
(CSA) and heavily compressed (HCA) layers, hash / sqrtsoftplus MoE, hyper-connections.

Per layer, following transformers' ``modeling_deepseek_v4``::

    q  = unweighted_rms(q_b(rms(q_a(x)))) , roped on its trailing rope_dim channels
    kv = rms(kv_proj(x)), roped                          (one head, key = value)
    compressed entries (CSA / HCA) from the compressor; CSA's indexer picks top-k of them
    o  = attention(q, window keys + entries, sinks) , un-roped at the query position
    out = o_b(grouped o_a(o))

Sliding layers rope with ``rope_theta``; CSA / HCA layers and their compressors with
``compress_rope_theta`` (+ YaRN). Attention runs on the backend the attention hook returns for
each layer's spec (``state_kv=True``); MoE through the MoE hook. The cache is the V4 split of
``deepseek_v4_kv`` (block KV + per-request state KV), sized by :meth:`kv_layout`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn as nn

from ...attention import AttentionLayerSpec, AttentionMetadata
from .. import ModelContext
from ..fast_init import allocate
from ..hf_weights import load_hf_weights
from .batch import StepPlans, V4Batch
from .compress import Compressor, Indexer, update_entries
from .config import CSA, LAYER_KINDS, SLIDING, V4Config, parse_config
from .decode import V4DecodeBatch, decode_select, decode_update_entries
from .kv import V4KVLayout, V4LayerCache, v4_kv_layout
from .layers import (  # fmt: skip
    GroupedLinear,
    HyperConnection,
    HyperHead,
    V4MoE,
    V4RMSNorm,
    V4Rope,
    keep_float32,
    moe_spec,
    step_ropes,
    unweighted_rms_norm,
)
from .mtp import NO_MTP_IN_CHECKPOINT, NO_MTP_IN_CONFIG, with_mtp_layers
from .weights import renamed

if TYPE_CHECKING:
    from ...fused_ops import FusedOps


def attention_spec(cfg: V4Config, index: int, kv_dtype: torch.dtype) -> AttentionLayerSpec:
    kind = cfg.layer_kinds[index]
    return AttentionLayerSpec(
        kind=LAYER_KINDS[kind],
        layer_index=index,
        num_heads=cfg.num_heads,
        num_kv_heads=1,
        head_dim=cfg.head_dim,
        v_head_dim=cfg.head_dim,
        scale=cfg.head_dim**-0.5,
        rope_dim=cfg.rope_dim,
        kv_shared=True,
        window=cfg.window,
        compress_ratio=cfg.compress_ratios[index],
        index_topk=cfg.index_topk if kind == CSA else 0,
        kv_dtype=kv_dtype,
        state_kv=True,
    )


class V4Attention(nn.Module):
    rope_kernel = None  # a platform's one-kernel V4Rope.apply (FusedOps.v4_rope), set by fused_ops.install
    norm_kernel = None  # a platform's one-kernel unweighted_rms_norm (FusedOps.v4_unweighted_rms_norm), likewise

    def __init__(self, cfg: V4Config, spec: AttentionLayerSpec, backend) -> None:
        super().__init__()
        self.cfg, self.spec, self.backend = cfg, spec, backend
        kind = cfg.layer_kinds[spec.layer_index]
        self.compressed = kind != SLIDING
        H, D, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(cfg.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, D, bias=False)
        self.kv_norm = V4RMSNorm(D, eps)
        self.o_a_proj = GroupedLinear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(H, dtype=torch.float32))
        if self.compressed:
            ratio = spec.compress_ratio
            self.compressor = Compressor(cfg.hidden_size, D, ratio, kind == CSA, eps)
            if kind == CSA:
                self.compressor.indexer = Indexer(cfg, ratio)

    def use_fused_ops(self, ops: FusedOps) -> bool:
        """Take a platform's one-kernel rope and query norm (``fused_ops.install``)."""
        if ops.v4_rope is None and ops.v4_unweighted_rms_norm is None:
            return False
        self.rope_kernel, self.norm_kernel = ops.v4_rope, ops.v4_unweighted_rms_norm
        return True

    def forward(
        self,
        x,
        positions,
        ropes,
        cache: V4LayerCache,
        meta: AttentionMetadata,
        batch: V4Batch,
        plans: StepPlans | None = None,
    ) -> torch.Tensor:
        T, H, D, eps = x.shape[0], self.cfg.num_heads, self.cfg.head_dim, self.cfg.rms_norm_eps
        rope = ropes["compress" if self.compressed else "main"]
        cos, sin = rope.cos_sin(positions, x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = (self.norm_kernel or unweighted_rms_norm)(self.q_b_proj(q_residual).view(T, H, D), eps)
        apply = self.rope_kernel if self.rope_kernel is not None else V4Rope.apply
        q = apply(q, cos, sin)
        kv = apply(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, D]
        selected = None
        if self.compressed:
            comp = self.compressor
            parts = [(comp, 0)]
            indexer = getattr(comp, "indexer", None)
            if indexer is not None:
                parts.append((indexer, D))
            scores = getattr(self.backend, "index_scores", None)
            scorer = None if scores is None else functools.partial(scores, meta=meta)
            if isinstance(batch, V4DecodeBatch):  # fixed shapes, no host sync (forward_decode)
                decode_update_entries(
                    parts,
                    [c.project(x) for c, _ in parts],
                    cache,
                    batch,
                    rope,
                    getattr(self.backend, "compress_decode", None),
                )
                if indexer is not None:
                    selected = decode_select(indexer, x, q_residual, cache, batch, rope, D, scorer, (cos, sin), apply)
            else:
                update_entries(parts, [c.project(x) for c, _ in parts], cache, batch, rope, meta.replay, plans)
                if indexer is not None:
                    selected = indexer.select(x, q_residual, positions, cache, batch, rope, D, scorer, plans)
        out = self.backend.forward_v4(self.spec, q, kv, self.sinks, cache, meta, selected)  # [T, H, D]
        out = apply(out, *rope.cos_neg_sin(positions, x.dtype))  # undo the values' rope at the query position
        grouped = self.o_a_proj(out.reshape(T, self.cfg.o_groups, -1)).flatten(1)
        return self.o_b_proj(grouped)


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, spec, backend, moe) -> None:
        super().__init__()
        self.self_attn = V4Attention(cfg, spec, backend)
        self.mlp = V4MoE(cfg, *moe)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, h, input_ids, positions, ropes, cache, meta, batch, plans=None):  # h [T, hc, D]
        post, comb, collapsed = self.attn_hc(h)
        out = self.self_attn(self.input_layernorm(collapsed), positions, ropes, cache, meta, batch, plans)
        h = self.attn_hc.merge(h, out, post, comb)
        post, comb, collapsed = self.ffn_hc(h)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return self.ffn_hc.merge(h, out, post, comb)


class V4MTPBlock(V4DecoderLayer):
    """A decoder block plus the MTP input mixing and head (see :mod:`.deepseek_v4_mtp`);
    parameter names are the released ``mtp.N.*`` in transformers' spelling."""

    def __init__(self, cfg: V4Config, spec, backend, moe) -> None:
        super().__init__(cfg, spec, backend, moe)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = V4RMSNorm(d, eps)
        self.hnorm = V4RMSNorm(d, eps)  # per stream
        self.norm = V4RMSNorm(d, eps)
        self.hc_head = HyperHead(cfg)

    def draft(self, streams, embeds, token_ids, positions, ropes, cache, meta, batch):
        """-> (hidden for the shared lm_head [T, D], output streams [T, hc, D])."""
        x = self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        out = self.forward(x, token_ids, positions, ropes, cache, meta, batch)
        return self.norm(self.hc_head(out)), out


class Backbone(nn.Module):
    def __init__(self, cfg: V4Config, layers: list[V4DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)


class DeepseekV4ForCausalLM(nn.Module):
    """Implements :class:`~deepinfer_core.models.CausalLM`; ``kv_caches`` are ``V4LayerCache``s."""

    def __init__(self, config: dict, ctx: ModelContext) -> None:
        super().__init__()
        cfg = parse_config(config)
        self.config, self.cfg = config, cfg
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self.attention_specs = [attention_spec(cfg, i, ctx.dtype) for i in range(cfg.num_layers)]
        backends = [ctx.attention_backend(spec) for spec in self.attention_specs]
        for spec, backend in zip(self.attention_specs, backends):
            if not hasattr(backend, "forward_v4"):
                raise ValueError(
                    f"attention backend {getattr(backend, 'name', backend)!r} for DeepSeek-V4 layer "
                    f"{spec.layer_index} ({spec.kind.value}) lacks forward_v4"
                )
        full = with_mtp_layers(cfg)  # MTP blocks as layers n.. for the per-layer builders
        self.mtp_attention_specs = [attention_spec(full, i, ctx.dtype) for i in range(cfg.num_layers, full.num_layers)]
        mtp_backends = [ctx.attention_backend(spec) for spec in self.mtp_attention_specs]
        moes = []
        for i in range(full.num_layers):
            spec = moe_spec(full, i)
            moes.append((spec, ctx.moe_dispatcher(spec)))
        with torch.device("meta"):
            layers = [V4DecoderLayer(cfg, s, b, m) for s, b, m in zip(self.attention_specs, backends, moes)]
            self.model = Backbone(cfg, layers)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            mtp = [
                V4MTPBlock(full, s, b, m)
                for s, b, m in zip(self.mtp_attention_specs, mtp_backends, moes[cfg.num_layers :])
            ]
            self.mtp = nn.ModuleList(mtp) if mtp else None
        self.mtp_unavailable = None if mtp else NO_MTP_IN_CONFIG  # why mtp_forward cannot run
        # cast while still on the meta device: materialising first in float32 and casting then
        # held the whole model in float32 for a moment (twice the bf16 bytes: V4-mini's load peak)
        self.to(dtype=ctx.dtype)
        self.restore_float32()
        allocate(self, ctx)  # packed modules swapped in, then = self.to_empty(device=ctx.device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ropes = {
            "main": V4Rope(cfg.rope_dim, cfg.main_rope, cfg.max_position_embeddings, ctx.device),
            "compress": V4Rope(cfg.rope_dim, cfg.compress_rope, cfg.max_position_embeddings, ctx.device),
        }
        self.requires_grad_(False)
        if ctx.expert_load is not None:  # the main layers (the MTP blocks are dropped with no weights)
            for layer in self.model.layers:
                ctx.expert_load.add_layer(layer.mlp.spec.layer_index, layer.mlp.spec.num_experts)
                layer.mlp.expert_load = ctx.expert_load

    def restore_float32(self) -> None:
        """Mixing weights, sinks, biases and norms in float32 whatever the model dtype, as
        transformers keeps them; called again after any cast of the whole model."""
        keep_float32(self)

    def kv_layout(self, block_size: int, num_speculative_tokens: int = 0) -> V4KVLayout:
        dtype = self.attention_specs[0].kv_dtype
        return v4_kv_layout(self.cfg, dtype, block_size, num_speculative_tokens)

    def mtp_kv_layout(self, block_size: int, num_speculative_tokens: int = 0) -> V4KVLayout:
        """Cache layout of the MTP blocks (one layer per block), allocated by the drafting loop."""
        full = with_mtp_layers(self.cfg)
        layout = v4_kv_layout(full, self.attention_specs[0].kv_dtype, block_size, num_speculative_tokens)
        return dataclasses.replace(layout, layers=layout.layers[self.cfg.num_layers :])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaded = load_hf_weights(self, renamed(weights), "DeepseekV4", optional_prefix="mtp.")
        if self.mtp is not None and not any(n.startswith("mtp.") for n in loaded):
            self.mtp = None  # the checkpoint has no MTP module: free its memory, drafting unavailable
            self.mtp_unavailable = NO_MTP_IN_CHECKPOINT
        for module in self.modules():
            if isinstance(module, V4MoE):
                module.bind_shared()

    def _batch(self, meta: AttentionMetadata) -> V4Batch:
        """The step's layout on the host: from the host-side copies the engine's batch builder
        attaches (``AttentionMetadata.host_*``), else read back from the device (a sync)."""
        if meta.state_slots is None:
            raise ValueError("DeepSeek-V4 needs per-request state KV: AttentionMetadata.state_slots is missing")
        starts, ends, slots = meta.host_query_start_loc, meta.host_seq_lens, meta.host_state_slots
        if starts is None or ends is None or slots is None:
            starts, ends, slots = meta.query_start_loc.tolist(), meta.seq_lens.tolist(), meta.state_slots.tolist()
        return V4Batch(
            token_ranges=tuple(zip(starts[:-1], starts[1:])),
            starts=tuple(e - (b - a) for e, a, b in zip(ends, starts[:-1], starts[1:])),
            slots=tuple(slots),
            block_tables=meta.block_tables,
            block_size=meta.block_size,
            prompt_lens=tuple(meta.prompt_lens or ()),
        )

    def hidden_streams(
        self, input_ids, positions, kv_caches: list[V4LayerCache], meta: AttentionMetadata, batch=None
    ) -> torch.Tensor:
        """The last layer's hyper-connection streams [T, hc, D], before ``hc_head`` and the final
        norm: what the MTP blocks consume. ``batch``: the layout, else built from ``meta``."""
        batch = self._batch(meta) if batch is None else batch
        plans = StepPlans()  # this forward's index plans, shared by the layers of each kind
        ropes = step_ropes(self.ropes)  # and its cos/sin, computed once per positions tensor
        e = self.model.embed_tokens(input_ids)
        h = e.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, input_ids, positions, ropes, cache, meta, batch, plans)
        return h

    def forward(self, input_ids, positions, kv_caches: list[V4LayerCache], meta: AttentionMetadata) -> torch.Tensor:
        return self.model.norm(self.model.hc_head(self.hidden_streams(input_ids, positions, kv_caches, meta)))

    def forward_hidden(self, input_ids, positions, kv_caches: list[V4LayerCache], meta: AttentionMetadata):
        """:meth:`forward` ([T, D]) and the last layer's streams before ``hc_head`` and the final
        norm ([T, hc, D], what the MTP blocks consume)."""
        streams = self.hidden_streams(input_ids, positions, kv_caches, meta)
        return self.model.norm(self.model.hc_head(streams)), streams

    def forward_decode(
        self, input_ids, positions, kv_caches: list[V4LayerCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """:meth:`forward` for a batch of one new token per request, with shapes fixed by the
        batch's size and block-table width and no host synchronisation (what a CUDA graph
        captures; see :mod:`.deepseek_v4_decode`). Not for replays or prefill rows."""
        return self.forward_decode_hidden(input_ids, positions, kv_caches, meta)[0]

    def forward_decode_hidden(
        self, input_ids, positions, kv_caches: list[V4LayerCache], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_decode` ([T, D]) and the last layer's streams before ``hc_head`` and the
        final norm ([T, hc, D]), as :meth:`forward_hidden`: a captured decode step that also
        keeps what the MTP drafter reads."""
        if meta.state_slots is None:
            raise ValueError("DeepSeek-V4 needs per-request state KV: AttentionMetadata.state_slots is missing")
        if meta.max_query_len != 1 or meta.replay or input_ids.shape[0] != meta.state_slots.shape[0]:
            raise ValueError(
                f"forward_decode takes one new token per request (not a replay): got {input_ids.shape[0]} tokens for "
                f"{meta.state_slots.shape[0]} requests, max_query_len={meta.max_query_len}, replay={meta.replay}"
            )
        batch = V4DecodeBatch(
            positions=positions, slots=meta.state_slots, block_tables=meta.block_tables, block_size=meta.block_size
        )
        streams = self.hidden_streams(input_ids, positions, kv_caches, meta, batch)
        return self.model.norm(self.model.hc_head(streams)), streams

    def mtp_forward(
        self,
        streams: torch.Tensor,
        next_token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: V4LayerCache,
        meta: AttentionMetadata,
        block: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits with MTP block ``block``: ``streams`` [T, hc, D] are the hidden streams at
        ``positions`` (from :meth:`hidden_streams`, or a previous call's output when chaining),
        ``next_token_ids`` [T] the tokens at ``positions + 1``. ``cache`` is this block's
        (:meth:`mtp_kv_layout`), ``meta`` laid out as for :meth:`forward`. Returns ``(logits
        [T, V] float32 for positions + 2, output streams [T, hc, D])``."""
        if self.mtp is None:
            raise RuntimeError(f"DeepSeek-V4 MTP drafting is unavailable: {self.mtp_unavailable}")
        if not 0 <= block < len(self.mtp):
            raise ValueError(
                f"MTP block {block} does not exist; this model has {len(self.mtp)} (num_nextn_predict_layers)"
            )
        T = streams.shape[0]
        if streams.shape[1:] != (self.cfg.hc_mult, self.cfg.hidden_size) or next_token_ids.shape != (T,):
            raise ValueError(
                f"mtp_forward: streams must be [T, hc_mult={self.cfg.hc_mult}, hidden_size={self.cfg.hidden_size}] and "
                f"next_token_ids [T]; got {tuple(streams.shape)} and {tuple(next_token_ids.shape)}"
            )
        embeds = self.model.embed_tokens(next_token_ids)
        hidden, out = self.mtp[block].draft(
            streams, embeds, next_token_ids, positions, step_ropes(self.ropes), cache, meta, self._batch(meta)
        )
        return self.compute_logits(hidden), out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def build(config: dict, ctx: ModelContext) -> DeepseekV4ForCausalLM:
    """Model factory registered for ``DeepseekV4ForCausalLM``."""
    return DeepseekV4ForCausalLM(config, ctx)

"""Attention on CUDA: Triton paged-attention kernels where Triton is importable, else the
core's torch reference running on the GPU (correct, not fast). Both use the reference cache
layout, so either can read a cache the other wrote."""

from __future__ import annotations

import importlib.util

from deepinfer_core.attention import AttentionKind, AttentionMetadata
from deepinfer_core.attention.torch_ref import SUPPORTED, TorchAttentionBackend, write_kv
from deepinfer_core.attention.v4_ref import SUPPORTED_V4, TorchV4AttentionBackend

PORTABLE_KINDS: frozenset[AttentionKind] = frozenset(SUPPORTED)
TRITON_KINDS: frozenset[AttentionKind] = frozenset({AttentionKind.FULL, AttentionKind.MLA, AttentionKind.SLIDING})


def triton_available() -> bool:
    """Whether the Triton kernels can be used (checked without importing Triton)."""
    return importlib.util.find_spec("triton") is not None


class PortableCudaAttention(TorchAttentionBackend):
    """The torch reference attention (paged cache, SDPA) on a CUDA device; correct, not fast."""

    name = "cuda-sm100-portable"


class PortableCudaV4Attention(TorchV4AttentionBackend):
    """DeepSeek-V4 layers (window in per-request state KV, compressed entries in block KV): the
    core's torch reference on a CUDA device; correct, not fast (used without Triton)."""

    name = "cuda-sm100-portable-v4"


class TritonV4Attention(TorchV4AttentionBackend):
    """DeepSeek-V4 sliding / CSA / HCA layers through
    :mod:`deepinfer_cuda_sm100.kernels.v4_attention`: one attention launch per layer (prefill,
    chunked prefill and split-KV decode) plus one ring-write launch. Head widths the kernel does
    not tile (not a power of two) take the reference path."""

    name = "cuda-sm100-triton-v4"

    def forward_v4(self, spec, q, kv, sinks, cache, meta: AttentionMetadata, selected=None):
        from .kernels.v4_attention import supported_head_dim, v4_attention

        if spec.kind not in SUPPORTED_V4 or not supported_head_dim(spec.head_dim) or meta.replay:
            # a replay's window is bounded to the replayed tokens (the reference does that; rare, short)
            return super().forward_v4(spec, q, kv, sinks, cache, meta, selected)
        if spec.kind is AttentionKind.COMPRESSED_SPARSE and selected is None:
            raise ValueError(
                f"{self.name}: compressed_sparse layer {spec.layer_index} needs the indexer's `selected` entry ids"
            )
        return v4_attention(
            spec.kind.value, q.contiguous(), kv.contiguous(), sinks.contiguous(), cache.window,
            cache.entries if spec.compress_ratio else None, selected.contiguous() if selected is not None else None,
            meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.state_slots,
            window=spec.window, ratio=spec.compress_ratio, block_size=meta.block_size, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, scale=spec.scale, batch_invariant=meta.batch_invariant,
        )  # fmt: skip

    def compress_decode(self, comp, new, cache, tail_col, entry_col, batch, cos, sin) -> bool:
        """One compressor's decode step (tail write, closing-window entry) in one launch
        (``V4AttentionBackend.compress_decode``); False (the core's torch ops) for widths the
        kernel does not tile."""
        from .kernels.v4_compressor import compress_decode

        if comp.dim < 16 or comp.dim & (comp.dim - 1):
            return False
        compress_decode(
            new, cache.tail, tail_col, batch.slots, batch.positions, comp.position_bias, comp.kv_norm.weight,
            comp.kv_norm.eps, cos, sin, cache.entries, entry_col, batch.block_tables, ratio=comp.ratio,
            block_size=batch.block_size, overlap=comp.overlap,
        )  # fmt: skip
        return True

    def index_scores(
        self, q, weights, entries, key_col, positions, batch, ratio, n_max, scale, meta: AttentionMetadata
    ):
        """The CSA indexer's masked scores [T, n_max] for the whole batch in one launch
        (``V4AttentionBackend.index_scores``); the core's top-k follows."""
        from .kernels.v4_indexer import index_scores

        if q.shape[-1] < 16 or q.shape[-1] & (q.shape[-1] - 1):  # no power-of-two tile: the core's torch path
            return None
        return index_scores(q, weights, entries, key_col, positions, meta.query_start_loc, batch.block_tables,
                            ratio=ratio, block_size=batch.block_size, n_max=n_max, scale=scale)  # fmt: skip


class TritonAttention(TorchAttentionBackend):
    """Paged attention through :mod:`deepinfer_cuda_sm100.kernels.paged_attention`: one launch
    per layer for prefill, chunked prefill and decode (split-KV), full/GQA/sliding and MLA.
    The KV write is one Triton launch per layer for K and V (the reference scatters each).
    MLA prefill-like steps run in the non-absorbed form instead (:meth:`expand_mla`)."""

    name = "cuda-sm100-triton"

    def __init__(self, mla_expand_min_tokens: int | None = None) -> None:
        from .mla_expanded import MIN_TOKENS

        # MLA steps with at least this many new tokens may run expanded (mla_expanded.wants_expanded)
        self.mla_expand_min_tokens = MIN_TOKENS if mla_expand_min_tokens is None else mla_expand_min_tokens

    def _write(self, spec, k, v, kv_cache, meta: AttentionMetadata) -> None:
        from .kernels.paged_attention import write_kv as write_kv_triton

        if kv_cache.dtype == k.dtype and kv_cache.is_contiguous():
            write_kv_triton(
                k, None if spec.kv_shared else v, kv_cache, meta.slot_mapping, spec.head_dim, spec.v_head_dim
            )
        else:
            write_kv(spec, k, v, kv_cache, meta.slot_mapping)

    def expand_mla(self, spec, meta: AttentionMetadata) -> bool:
        """Run this step's MLA layer in the non-absorbed form (prefill-like steps)."""
        from .mla_expanded import wants_expanded

        return wants_expanded(spec, meta, self.mla_expand_min_tokens)

    def forward_mla_expanded(self, spec, q, key, kv_b_weight, kv_cache, meta: AttentionMetadata):
        """The latent entry written as :meth:`forward` writes it, then per-head attention over
        the decompressed context (:mod:`deepinfer_cuda_sm100.mla_expanded`)."""
        from .mla_expanded import expanded_attention

        self._write(spec, key, None, kv_cache, meta)
        return expanded_attention(spec, q, key, kv_b_weight, kv_cache, meta)

    def forward(self, spec, q, k, v, kv_cache, meta: AttentionMetadata):
        from .kernels.paged_attention import paged_attention

        self._write(spec, k, v, kv_cache, meta)
        return paged_attention(
            q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=spec.scale,
            v_head_dim=spec.v_head_dim, kv_shared=spec.kv_shared, window=spec.window,
            batch_invariant=meta.batch_invariant,
        )  # fmt: skip

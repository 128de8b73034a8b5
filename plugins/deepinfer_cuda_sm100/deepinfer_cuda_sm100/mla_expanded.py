"""MLA prefill in the non-absorbed ("expanded") form, for ``TritonAttention``.

The model hands over the queries ``[q_nope ; rope(q_pe)]`` per head, the new tokens' cache entry
``[c_kv ; rope(k_pe)]`` and ``kv_b_proj``'s weight (``AttentionBackend.forward_mla_expanded``,
docs/writing-plugins.md). We write the entry to the paged cache exactly as the absorbed path
does (decode reads it unchanged), take every context token's entry (a cached prefix from the
cache, the new tokens as given), decompress the latents through ``kv_b_proj`` in one GEMM and run
:func:`~deepinfer_cuda_sm100.kernels.mla_prefill.mla_prefill_attention`.

When it pays: per context token the decompression costs one ``kv_b_proj`` row (a GEMM at full
speed); per (query, key) pair and head the expanded form saves 768 of 1,088 multiply-adds and
runs in 128-row tiles. So a prefill step (few keys per query) gains and a decode step (a whole
context decompressed for one query) loses: :func:`wants_expanded`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec, AttentionMetadata

# A step runs expanded when it has at least this many new tokens and at most KEYS_PER_QUERY
# context tokens (cached prefix included) per new token.
MIN_TOKENS = 128
KEYS_PER_QUERY = 4


def wants_expanded(spec: AttentionLayerSpec, meta: AttentionMetadata, min_tokens: int = MIN_TOKENS) -> bool:
    """Whether this step's MLA layers should run expanded. Needs the host-side context size
    (``meta.num_context_tokens``; 0, as in a captured decode graph, means unknown: absorbed);
    batch-invariant steps stay absorbed (their arithmetic must not depend on the batch)."""
    T, K = meta.num_tokens, meta.num_context_tokens
    return (
        spec.kind is AttentionKind.MLA and not meta.batch_invariant and meta.max_query_len > 1
        and K > 0 and T >= min_tokens and K <= KEYS_PER_QUERY * T
    )  # fmt: skip


def context_entries(spec: AttentionLayerSpec, key: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entries [K, latent + rope], key_start_loc [R+1])``: every request's context entries,
    request after request. Without a cached prefix (K == T) they are the new tokens' own entries
    (what the cache now holds when its dtype is the key's); else gathered from the cache."""
    T = key.shape[0]
    if meta.num_context_tokens == T and kv_cache.dtype == key.dtype:
        return key[:, 0, :], meta.query_start_loc
    K, R, bs = meta.num_context_tokens, meta.num_requests, meta.block_size
    key_start = torch.zeros(R + 1, dtype=torch.int32, device=key.device)
    torch.cumsum(meta.seq_lens, 0, out=key_start[1:])
    req = torch.repeat_interleave(torch.arange(R, device=key.device), meta.seq_lens, output_size=K)
    pos = torch.arange(K, device=key.device) - key_start[req].long()
    slots = meta.block_tables[req, pos // bs].long() * bs + pos % bs
    width = kv_cache.shape[-1]
    rows = kv_cache.view(-1, width)  # one plane, one KV head: [slots, latent + rope]
    return rows.index_select(0, slots)[:, : spec.head_dim].to(key.dtype), key_start


def expanded_attention(spec: AttentionLayerSpec, q: torch.Tensor, key: torch.Tensor, kv_b_weight: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """``q [T, H, n + r]``, ``key [T, 1, C + r]`` (already in the cache), ``kv_b_weight
    [H, n + v, C]`` -> ``[T, H, v]``: attention over each request's context, keys and values
    decompressed per head."""
    from .kernels.mla_prefill import mla_prefill_attention

    H, nv, C = kv_b_weight.shape
    n = q.shape[-1] - spec.rope_dim
    entries, key_start = context_entries(spec, key, kv_cache, meta)  # [K, C + r]
    kv = F.linear(entries[:, :C], kv_b_weight.reshape(H * nv, C).to(entries.dtype)).view(-1, H, nv)  # [K, H, n + v]
    return mla_prefill_attention(
        q, kv[..., :n], entries[:, C:], kv[..., n:], meta.query_start_loc, key_start, meta.seq_lens,
        max_query_len=meta.max_query_len, scale=spec.scale,
    )  # fmt: skip

"""MLA prefill in the non-absorbed ("expanded") form, for ``TritonAttention``.

The model hands over the queries ``[q_nope ; rope(q_pe)]`` per head, the new tokens' cache entry
``[c_kv ; rope(k_pe)]`` and ``kv_b_proj``'s weight (``AttentionBackend.forward_mla_expanded``,
docs/writing-plugins.md). We write the entry to the paged cache exactly as the absorbed path
does (decode reads it unchanged), take every context token's entry (a cached prefix from the
cache, the new tokens as given), decompress the latents through ``kv_b_proj`` in one GEMM and run
:func:`~deepinfer_cuda_sm100.kernels.mla_prefill.mla_prefill_attention`.

When it pays (per head, bf16, H200 figures of benchmarks/README.md): the absorbed form spends
~2 x 1,088 FLOP per causal (query, key) pair at ~70 TFLOP/s, the expanded form ~2 x 320 at
several times that, so each pair saves ~30 fs; each context token the expanded form decompresses
costs a 512 x 256 GEMM row (~0.5 ns), and each new token the absorbed form multiplies into and
out of the latent costs the same. So expanded wins when ``pairs * 30 fs > (K - T) * 0.5 ns``,
i.e. pairs > ~17 x (context tokens - new tokens): every prefill without a prefix, a long chunk
over a long prefix (a 2,048 chunk over 30k cached tokens: 63M pairs against 30k x 17), but not a
step of decode rows over long contexts (one pair per context token): :func:`wants_expanded`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec, AttentionMetadata

# A step runs expanded when it has at least MIN_TOKENS new tokens and at least PAIRS_PER_KEY
# causal (query, key) pairs per context token it must decompress beyond its new ones (twice the
# break-even estimate above: the estimate is rough and the absorbed form is the tested default).
MIN_TOKENS = 128
PAIRS_PER_KEY = 32
# The decompressed keys and values of a step live for one layer: at most this many
# (context token, head) rows (2 GiB in bf16 at V3's 128 + 128 channels per head: 32k context
# tokens at DeepSeek-V3's 128 heads, 256k at V3-mini's 16); a larger step stays absorbed.
MAX_KEY_HEADS = 1 << 22


def wants_expanded(spec: AttentionLayerSpec, meta: AttentionMetadata, min_tokens: int = MIN_TOKENS) -> bool:
    """Whether this step's MLA layers should run expanded, from host-side counts only
    (``meta.num_context_tokens`` and ``meta.num_attention_pairs``; 0, as in a captured decode
    graph, means unknown: absorbed). Batch-invariant steps stay absorbed (their arithmetic must
    not depend on the batch)."""
    T, K, pairs = meta.num_tokens, meta.num_context_tokens, meta.num_attention_pairs
    return (
        spec.kind is AttentionKind.MLA and not meta.batch_invariant and meta.max_query_len > 1
        and K > 0 and pairs > 0 and T >= min_tokens and pairs >= PAIRS_PER_KEY * (K - T)
        and K * spec.num_heads <= MAX_KEY_HEADS
    )  # fmt: skip


def context_entries(
    spec: AttentionLayerSpec, key: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
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


def expanded_attention(
    spec: AttentionLayerSpec,
    q: torch.Tensor,
    key: torch.Tensor,
    kv_b_weight: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
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

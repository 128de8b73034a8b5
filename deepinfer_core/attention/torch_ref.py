"""Pure-torch reference attention over the paged KV cache (every device torch supports).

Cache layout per layer (one tensor; K and V in separate planes, head-major, so that a gathered
head's keys and values are each a contiguous matrix the matmuls read without copying)::

    [planes, num_kv_heads, num_blocks, block_size, width]
     planes = 1 when kv_shared (V is the first v_head_dim channels of K), else 2 (K, V)
     width = max(head_dim, v_head_dim);  block b, offset o  <->  slot b * block_size + o

Three paths:

* decode (every request has one new token): gather each request's slots with one
  ``index_select`` and run two batched matmuls per KV head group (no padding of queries);
* mixed / prefill: queries padded to ``[R, max_query_len]``, one masked SDPA;
* batch invariant: each request on its exact lengths, so its reductions never depend on the
  rest of the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import AttentionCapabilities, AttentionKind, AttentionLayerSpec, AttentionMetadata

__all__ = ["SUPPORTED", "TorchAttentionBackend", "write_kv"]


SUPPORTED = {AttentionKind.FULL, AttentionKind.MLA, AttentionKind.SLIDING}


class TorchAttentionBackend:
    name = "torch-reference"
    capabilities = AttentionCapabilities(kinds=frozenset(SUPPORTED))

    def kv_cache_shape(self, spec: AttentionLayerSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        planes = 1 if spec.kv_shared else 2
        return (planes, spec.num_kv_heads, num_blocks, block_size, max(spec.head_dim, spec.v_head_dim))

    def cache_rows(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as ``[num_slots, planes * num_kv_heads * width]`` (for inspection and tests)."""
        planes, heads, blocks, bs, width = kv_cache.shape
        return kv_cache.permute(2, 3, 0, 1, 4).reshape(blocks * bs, planes * heads * width)

    def forward(self, spec, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(spec, k, v, kv_cache, meta.slot_mapping)
        if meta.batch_invariant:
            return self._forward_per_request(spec, q, kv_cache, meta)
        if meta.max_query_len == 1 and q.shape[0] == meta.num_requests:
            return self._forward_decode(spec, q, kv_cache, meta)
        return self._forward_padded(spec, q, kv_cache, meta)

    def _forward_decode(self, spec, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        R, smax, bs = meta.num_requests, meta.max_seq_len, kv_cache.shape[3]
        slots = _memo(meta, ("slots", bs, smax), lambda: gather_slots(meta.block_tables, bs, smax))
        keys, values = gather_kv(spec, kv_cache, meta.block_tables, smax, slots)  # [Hkv, R, S, D]
        groups = spec.num_heads // spec.num_kv_heads
        qg = q.view(R, spec.num_kv_heads, groups, spec.head_dim).transpose(0, 1)  # [Hkv, R, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2).to(q.dtype)).float() * spec.scale  # [Hkv, R, G, S]
        masked = _memo(meta, ("decode_mask", smax, spec.window), lambda: _decode_mask(meta, smax, spec.window))
        probs = scores.masked_fill(masked, float("-inf")).softmax(dim=-1)
        out = torch.matmul(probs.to(q.dtype), values.to(q.dtype))  # [Hkv, R, G, Dv]
        return out.permute(1, 0, 2, 3).reshape(R, spec.num_heads, spec.v_head_dim)

    def _forward_padded(self, spec, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_reqs, qmax, smax = meta.num_requests, meta.max_query_len, meta.max_seq_len
        T = q.shape[0]
        qlens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [R]
        req_of_tok = torch.repeat_interleave(torch.arange(num_reqs, device=q.device), qlens, output_size=T)
        local = torch.arange(T, device=q.device) - meta.query_start_loc[req_of_tok].long()  # [T]
        q_pad = q.new_zeros(num_reqs, qmax, spec.num_heads, spec.head_dim)
        q_pad[req_of_tok, local] = q
        pos_pad = torch.full((num_reqs, qmax), -1, dtype=torch.long, device=q.device)
        pos_pad[req_of_tok, local] = meta.positions

        keys, values = gather_kv(spec, kv_cache, meta.block_tables, smax)  # [Hkv, R, S, D]
        key_pos = torch.arange(smax, device=q.device)
        allowed = key_pos[None, None, :] <= pos_pad[:, :, None]  # causal, [R, Q, S]
        allowed &= key_pos[None, None, :] < meta.seq_lens[:, None, None]
        if spec.window is not None:
            allowed &= key_pos[None, None, :] > pos_pad[:, :, None] - spec.window
        allowed[:, :, 0] |= pos_pad < 0  # padded query rows: keep softmax finite, output dropped

        out = _sdpa(spec, q_pad, keys, values, allowed)  # [R, Q, H, Dv]
        return out[req_of_tok, local]

    def _forward_per_request(self, spec, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = q.new_empty(q.shape[0], spec.num_heads, spec.v_head_dim)
        starts = meta.query_start_loc.tolist()
        for r, seq_len in enumerate(meta.seq_lens.tolist()):
            a, b = starts[r], starts[r + 1]
            if a == b:
                continue
            keys, values = gather_kv(spec, kv_cache, meta.block_tables[r : r + 1], seq_len)
            pos = meta.positions[a:b]
            key_pos = torch.arange(seq_len, device=q.device)
            allowed = key_pos[None, :] <= pos[:, None]
            if spec.window is not None:
                allowed &= key_pos[None, :] > pos[:, None] - spec.window
            out[a:b] = _sdpa(spec, q[None, a:b], keys, values, allowed[None])[0]
        return out


def write_kv(spec: AttentionLayerSpec, k, v, kv_cache, slot_mapping) -> None:
    """Store the new tokens' K (and V) at their slots: [T, Hkv, D] -> cache[plane, :, slot]."""
    planes = kv_cache.view(kv_cache.shape[0], spec.num_kv_heads, -1, kv_cache.shape[-1])  # [P, Hkv, slots, W]
    planes[0, :, slot_mapping, : spec.head_dim] = k.transpose(0, 1).to(kv_cache.dtype)
    if not spec.kv_shared:
        planes[1, :, slot_mapping, : spec.v_head_dim] = v.transpose(0, 1).to(kv_cache.dtype)


def _memo(meta: AttentionMetadata, key: tuple, make):
    """``make()`` once per forward when the model attached a scratch memo to ``meta``."""
    if meta.scratch is None:
        return make()
    value = meta.scratch.get(key)
    if value is None:
        value = meta.scratch[key] = make()
    return value


def _decode_mask(meta: AttentionMetadata, smax: int, window: int | None) -> torch.Tensor:
    """``[1, R, 1, S]``: True where a decode query must not see key position s."""
    key_pos = torch.arange(smax, device=meta.positions.device)
    masked = key_pos[None, :] > meta.positions[:, None]  # [R, S]
    if window is not None:
        masked |= key_pos[None, :] <= meta.positions[:, None] - window
    return masked[None, :, None, :]


def gather_slots(block_tables, block_size: int, max_len: int) -> torch.Tensor:
    """Cache slots of the first ``max_len`` positions of each request: ``[R * max_len]``."""
    pos = torch.arange(max_len, device=block_tables.device)
    return (block_tables[:, pos // block_size].long() * block_size + pos % block_size).flatten()


def gather_kv(spec: AttentionLayerSpec, kv_cache, block_tables, max_len: int, slots: torch.Tensor | None = None):
    """Keys and values of the first ``max_len`` positions of each request's block table:
    ``[Hkv, R, max_len, D]`` and ``[Hkv, R, max_len, Dv]``, gathered by one ``index_select``
    (``slots``: :func:`gather_slots`'s result, when the caller already has it)."""
    num_reqs = block_tables.shape[0]
    if slots is None:
        slots = gather_slots(block_tables, kv_cache.shape[3], max_len)
    planes = kv_cache.view(kv_cache.shape[0], spec.num_kv_heads, -1, kv_cache.shape[-1])
    kv = planes.index_select(2, slots).view(kv_cache.shape[0], spec.num_kv_heads, num_reqs, max_len, -1)
    keys = kv[0, ..., : spec.head_dim]
    values = kv[0 if spec.kv_shared else 1, ..., : spec.v_head_dim]
    return keys, values


def _sdpa(spec: AttentionLayerSpec, q, keys, values, allowed):
    # q [R, Q, H, D], keys [Hkv, R, S, D], values [Hkv, R, S, Dv], allowed [R, Q, S]
    qh = q.transpose(1, 2)  # [R, H, Q, D]
    kh = keys.transpose(0, 1).to(q.dtype)  # [R, Hkv, S, D]
    vh = values.transpose(0, 1).to(q.dtype)
    gqa = spec.num_heads != spec.num_kv_heads
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed[:, None], scale=spec.scale, enable_gqa=gqa)
    return out.transpose(1, 2)  # [R, Q, H, Dv]

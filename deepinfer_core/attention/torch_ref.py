"""Pure-torch reference attention over the paged KV cache (every device torch supports).

Cache layout per layer (one tensor)::

    [num_blocks, block_size, num_kv_heads, head_dim (+ v_head_dim unless kv_shared)]
     block b, offset o  <->  slot b * block_size + o

The batched path pads queries to ``[R, max_query_len]`` and keys to ``[R, max_seq_len]`` and
runs one masked SDPA; the batch-invariant path runs each request on its exact lengths so its
reductions never see another request's padding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import AttentionKind, AttentionLayerSpec, AttentionMetadata

SUPPORTED = {AttentionKind.FULL, AttentionKind.MLA, AttentionKind.SLIDING}


class TorchAttentionBackend:
    name = "torch-reference"

    def kv_cache_shape(self, spec: AttentionLayerSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        width = spec.head_dim if spec.kv_shared else spec.head_dim + spec.v_head_dim
        return (num_blocks, block_size, spec.num_kv_heads, width)

    def forward(self, spec, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(spec, k, v, kv_cache, meta.slot_mapping)
        if meta.batch_invariant:
            return self._forward_per_request(spec, q, kv_cache, meta)
        return self._forward_padded(spec, q, kv_cache, meta)

    # -- batched: one SDPA over padded requests --------------------------------------------
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

        keys, values = gather_kv(spec, kv_cache, meta.block_tables, smax)  # [R, S, Hkv, D]
        key_pos = torch.arange(smax, device=q.device)
        allowed = key_pos[None, None, :] <= pos_pad[:, :, None]  # causal, [R, Q, S]
        allowed &= key_pos[None, None, :] < meta.seq_lens[:, None, None]
        if spec.window is not None:
            allowed &= key_pos[None, None, :] > pos_pad[:, :, None] - spec.window
        allowed[:, :, 0] |= pos_pad < 0  # padded query rows: keep softmax finite, output dropped

        out = _sdpa(spec, q_pad, keys, values, allowed)  # [R, Q, H, Dv]
        return out[req_of_tok, local]

    # -- batch invariant: exact lengths per request ------------------------------------------
    def _forward_per_request(self, spec, q, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = q.new_empty(q.shape[0], spec.num_heads, spec.v_head_dim)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for r, seq_len in enumerate(seq_lens):
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
    flat = kv_cache.view(-1, spec.num_kv_heads, kv_cache.shape[-1])
    entry = k if spec.kv_shared else torch.cat([k, v], dim=-1)
    flat[slot_mapping] = entry.to(kv_cache.dtype)


def gather_kv(spec: AttentionLayerSpec, kv_cache, block_tables, max_len: int):
    """Contiguous K and V for requests' block tables, truncated to ``max_len`` tokens."""
    num_reqs, max_blocks = block_tables.shape
    bs = kv_cache.shape[1]
    need = min(max_blocks, -(-max_len // bs))
    kv = kv_cache[block_tables[:, :need].long()]  # [R, nb, bs, Hkv, W]
    kv = kv.reshape(num_reqs, need * bs, spec.num_kv_heads, -1)[:, :max_len]
    keys = kv[..., : spec.head_dim]
    values = kv[..., : spec.v_head_dim] if spec.kv_shared else kv[..., spec.head_dim :]
    return keys, values


def _sdpa(spec: AttentionLayerSpec, q, keys, values, allowed):
    # q [R, Q, H, D], keys [R, S, Hkv, D], values [R, S, Hkv, Dv], allowed [R, Q, S]
    groups = spec.num_heads // spec.num_kv_heads
    qh = q.transpose(1, 2)
    kh = keys.transpose(1, 2).to(q.dtype)
    vh = values.transpose(1, 2).to(q.dtype)
    if groups > 1:
        kh = kh.repeat_interleave(groups, dim=1)
        vh = vh.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed[:, None], scale=spec.scale)
    return out.transpose(1, 2)  # [R, Q, H, Dv]

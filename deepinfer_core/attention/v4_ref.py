"""Pure-torch reference attention for the DeepSeek-V4 kinds (sliding, CSA, HCA).

Per request (exact lengths, so results never depend on the rest of the batch):

    keys = [ ring rows of positions max(0, s-W+1)..s-1 | new keys s..e-1 | compressed entries ]
    score(t, j) = q_t . key_j * scale, masked to the window (p - W < pos <= p) and, for
                  entries, to visibility (HCA) or the indexer's choice (CSA)
    softmax over the scores plus one sink logit per head; the sink takes mass but adds nothing
    out_t = sum_j prob(t, j) key_j        (K = V)

then the new keys go into the ring at ``pos % rows``. A replay (``meta.replay``: tokens re-run
to rebuild state KV after a prefix hit) reads no ring rows before its first position: its window
attention is bounded to the replayed tokens, whatever the slot held before (engine/state_replay.py).
"""

from __future__ import annotations

import torch

from . import AttentionCapabilities, AttentionKind, AttentionLayerSpec, AttentionMetadata

__all__ = ["SUPPORTED_V4", "TorchV4AttentionBackend"]


_QUERY_CHUNK = 256
SUPPORTED_V4 = {AttentionKind.SLIDING, AttentionKind.COMPRESSED_SPARSE, AttentionKind.HEAVILY_COMPRESSED}


class TorchV4AttentionBackend:
    name = "torch-reference-v4"
    capabilities = AttentionCapabilities(state_kv_kinds=frozenset(SUPPORTED_V4))

    def forward_v4(self, spec: AttentionLayerSpec, q, kv, sinks, cache, meta: AttentionMetadata, selected=None):
        if spec.kind not in SUPPORTED_V4:
            raise ValueError(f"{self.name} does not implement attention kind {spec.kind.value!r}")
        if meta.max_query_len == 1 and q.shape[0] == meta.num_requests and not (meta.batch_invariant or meta.replay):
            return self._decode(spec, q, kv, sinks, cache, meta, selected)
        out = q.new_empty(q.shape)
        starts = meta.query_start_loc.tolist()
        ends = meta.seq_lens.tolist()
        slots = meta.state_slots.tolist()
        ring = cache.window  # [slots, rows, D]
        rows = ring.shape[1]
        W = spec.window
        for r, slot in enumerate(slots):
            a, b = starts[r], starts[r + 1]
            if a == b:
                continue
            e = ends[r]
            s = e - (b - a)
            lo = s if meta.replay else max(0, s - W + 1)  # a replay's window starts at the replay (bounded)
            old = ring[slot, torch.arange(lo, s, device=q.device) % rows].to(kv.dtype)
            keys = torch.cat([old, kv[a:b]], dim=0)  # positions lo..e-1
            pos = meta.positions[a:b]
            ents = visible = None
            if spec.kind is not AttentionKind.SLIDING:
                ents, visible = self._entries(
                    spec, cache, meta, r, e, pos, selected[a:b] if selected is not None else None
                )
                ents = ents.to(kv.dtype)
            # queries in chunks: a chunk only needs its own window of keys, not the whole prompt
            for c in range(0, b - a, _QUERY_CHUNK):
                c_end = min(c + _QUERY_CHUNK, b - a)
                k_lo = max(lo, s + c - W + 1)
                k_hi = s + c_end
                ck = keys[k_lo - lo : k_hi - lo]
                key_pos = torch.arange(k_lo, k_hi, device=q.device)
                cpos = pos[c:c_end]
                mask = (key_pos[None, :] <= cpos[:, None]) & (key_pos[None, :] > cpos[:, None] - W)
                if ents is not None:
                    ck = torch.cat([ck, ents], dim=0)
                    mask = torch.cat([mask, visible[c:c_end]], dim=1)
                out[a + c : a + c_end] = _attend(q[a + c : a + c_end], ck, mask, sinks, spec.scale)
            keep = max(s, e - rows)
            ring[slot, torch.arange(keep, e, device=q.device) % rows] = kv[a + keep - s : b].to(ring.dtype)
        return out

    def _decode(self, spec, q, kv, sinks, cache, meta: AttentionMetadata, selected):
        """Every request has one new token: one batched gather and attention for all of them."""
        ring = cache.window
        rows, W, dev = ring.shape[1], spec.window, q.device
        pos = meta.positions  # [R]
        slots = meta.state_slots
        back = torch.arange(-(W - 1), 0, device=dev)  # the W-1 positions before each token
        key_pos = pos[:, None] + back[None, :]  # [R, W-1]
        old = ring[slots[:, None], key_pos.remainder(rows)].to(kv.dtype)  # [R, W-1, D]
        keys = torch.cat([old, kv[:, None, :]], dim=1)  # [R, W, D]
        mask = torch.cat([key_pos >= 0, torch.ones_like(pos[:, None], dtype=torch.bool)], dim=1)
        if spec.kind is not AttentionKind.SLIDING:
            ratio = spec.compress_ratio
            per_block = meta.block_size // ratio
            n = max(1, (int(meta.max_seq_len)) // ratio)
            ids = torch.arange(n, device=dev)
            blocks = meta.block_tables.long().gather(
                1, (ids // per_block).expand(pos.shape[0], -1).clamp(max=meta.block_tables.shape[1] - 1)
            )
            ents = cache.entries[blocks, (ids % per_block)[None, :], : spec.head_dim].to(kv.dtype)  # [R, n, D]
            if selected is None:
                visible = ids[None, :] < ((pos + 1) // ratio)[:, None]
            else:
                visible = torch.zeros(pos.shape[0], n + 1, dtype=torch.bool, device=dev)
                visible.scatter_(1, torch.where(selected >= 0, selected, n), True)
                visible = visible[:, :n]
            keys = torch.cat([keys, ents], dim=1)
            mask = torch.cat([mask, visible], dim=1)
        scores = torch.matmul(q, keys.transpose(1, 2)) * spec.scale  # [R, H, K]
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        sink = sinks.to(scores.dtype).view(1, -1, 1).expand(scores.shape[0], -1, 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1)[..., :-1]
        out = torch.matmul(probs.to(keys.dtype), keys)  # [R, H, D]
        ring[slots, pos.remainder(rows)] = kv.to(ring.dtype)
        return out

    @staticmethod
    def _entries(spec, cache, meta, r: int, e: int, pos, selected):
        ratio = spec.compress_ratio
        n = e // ratio
        ids = torch.arange(n, device=pos.device)
        per_block = meta.block_size // ratio
        blocks = meta.block_tables[r].long()[ids // per_block]
        ents = cache.entries[blocks, ids % per_block, : spec.head_dim]  # [n, D]
        if selected is None:  # HCA: every finished window up to the query
            visible = ids[None, :] < ((pos + 1) // ratio)[:, None]
        else:  # CSA: only what the indexer chose (-1 = nothing)
            visible = torch.zeros(pos.shape[0], n + 1, dtype=torch.bool, device=pos.device)
            visible.scatter_(1, torch.where(selected >= 0, selected, n), True)
            visible = visible[:, :n]
        return ents, visible


def _attend(q, keys, mask, sinks, scale):
    # q [t, H, D], keys [K, D] (K = V), mask [t, K] -> [t, H, D]; as transformers' eager path
    scores = torch.matmul(q.transpose(0, 1), keys.t()) * scale  # [H, t, K]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = logits.softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys).transpose(0, 1)

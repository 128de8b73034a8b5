"""Paged KV blocks with prefix caching.

Blocks hold ``block_size`` tokens of every layer's KV. A *full* block whose tokens are all
computed gets a key in a hash chain::

    key_0 = H(namespace, b"",    tokens[0:128])
    key_1 = H(namespace, key_0,  tokens[128:256])   ... so a key names its whole prefix.

The namespace fingerprints model weights, KV dtype, cache layout and block size, so blocks of
another model or layout can never match. Freed blocks keep their key and stay reusable until
the pool needs them (LRU eviction); a block with references is never evicted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from .request import Request


def block_key(namespace: bytes, parent: bytes, tokens) -> bytes:
    """One link of the hash chain: the key of a full block of ``tokens`` after ``parent``'s."""
    h = hashlib.sha256(namespace)
    h.update(parent)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))  # each id as 4 little-endian bytes, packed in C
    return h.digest()


def chain_keys(namespace: bytes, token_ids, block_size: int) -> list[bytes]:
    """The keys of every full block of ``token_ids`` (what an engine with this namespace computes;
    the cluster's router matches prompts against the keys replicas publish)."""
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys.append(block_key(namespace, keys[-1] if keys else b"", token_ids[start : start + block_size]))
    return keys


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_key: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> block id
        # Free blocks, least recently freed first; the front is evicted first.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.block_key[block]
        if key is not None:  # evict: its content is about to be overwritten
            del self.cached[key]
            self.block_key[block] = None
        self.ref_counts[block] = 1
        return block

    def touch(self, block: int) -> None:
        """Take a reference to a cached block (a prefix hit)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.block_key[block] is None:  # nothing worth keeping: reuse first
                self.free.move_to_end(block, last=False)

    def register(self, block: int, key: bytes) -> None:
        if self.block_key[block] is None and key not in self.cached:
            self.block_key[block] = key
            self.cached[key] = block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: str | None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enabled = namespace is not None  # None: prefix caching off
        self.namespace = (namespace or "").encode()
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # ... and found
        self.state = None  # StateKVSlots of models with per-request state KV (released in free)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def _update_keys(self, req: Request) -> None:
        """Extend the request's hash chain over all of its full known blocks."""
        bs = self.block_size
        while (len(req.block_keys) + 1) * bs <= req.num_tokens:
            i = len(req.block_keys)
            parent = req.block_keys[-1] if req.block_keys else b""
            req.block_keys.append(block_key(self.namespace, parent, req.token_slice(i * bs, (i + 1) * bs)))

    def prefix_keys(self, token_ids) -> list[bytes]:
        """The hash-chain keys of the full blocks of ``token_ids`` (the keys a request with
        these tokens would look up); pure: no request, no counter, no block is touched."""
        return chain_keys(self.namespace, token_ids, self.block_size)

    def cached_prefix(self, keys) -> int:
        """How many leading ``keys`` are cached in device blocks now (read only)."""
        if not self.enabled:
            return 0
        n = 0
        for key in keys:
            if key not in self.pool.cached:
                break
            n += 1
        return n

    def match_prefix(self, req: Request) -> list[int]:
        """Cached blocks for the request's leading full blocks. The last known token is never
        served from the cache: its logits must be computed."""
        if not self.enabled:
            return []
        self._update_keys(req)
        usable = (req.num_tokens - 1) // self.block_size
        hits = []
        for key in req.block_keys[:usable]:
            block = self.pool.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, req: Request, num_new_tokens: int, prefix_blocks: list[int] = ()) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens (after taking ``prefix_blocks``
        as its first blocks). All or nothing: returns False and changes nothing when short."""
        if not prefix_blocks:  # a running request (every decode step of every request)
            new = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(req.block_ids)
            if new <= 0:
                return True
            if new > len(self.pool.free):
                return False
            req.block_ids.extend(self.pool.allocate() for _ in range(new))
            return True
        needed_total = -(
            -(req.num_computed_tokens + len(prefix_blocks) * self.block_size + num_new_tokens) // self.block_size
        )
        have = len(req.block_ids) + len(prefix_blocks)
        new = max(0, needed_total - have)
        reclaim = sum(1 for b in prefix_blocks if self.pool.ref_counts[b] == 0)
        if new + reclaim > self.pool.num_free:
            return False
        for block in prefix_blocks:
            self.pool.touch(block)
        req.block_ids.extend(prefix_blocks)
        req.block_ids.extend(self.pool.allocate() for _ in range(new))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Publish keys for blocks whose every token now has KV computed."""
        if not self.enabled:
            return
        self._update_keys(req)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_keys))
        for i in range(full):
            self.pool.register(req.block_ids[i], req.block_keys[i])

    def free(self, req: Request) -> None:
        # Tail first, so that a prefix outlives its suffixes in the LRU order.
        for block in reversed(req.block_ids):
            self.pool.release(block)
        req.block_ids.clear()
        if self.state is not None:
            self.state.release(req.request_id)

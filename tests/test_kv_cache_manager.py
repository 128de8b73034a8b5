"""Paged blocks and the prefix cache: hash chain, reference counts, LRU eviction."""

from deepinfer_core.engine.kv_cache_manager import BlockPool, KVCacheManager
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.sampling_params import SamplingParams

BS = 4


def make(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(), seed=0)


def run_prefill(kv, req):
    hits = kv.match_prefix(req)
    assert kv.allocate(req, req.num_tokens - len(hits) * BS, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return hits


def test_second_identical_prompt_hits_all_full_blocks_but_the_last_token():
    kv = KVCacheManager(16, BS, "ns")
    a = make(range(10))  # 2 full blocks + 2 tokens
    run_prefill(kv, a)
    kv.free(a)
    b = make(range(10), "b")
    hits = kv.match_prefix(b)
    assert len(hits) == 2
    c = make(range(8), "c")  # exactly two blocks: the last token must be computed
    assert len(kv.match_prefix(c)) == 1


def test_chain_key_depends_on_whole_prefix_and_namespace():
    kv = KVCacheManager(16, BS, "ns")
    run_prefill(kv, make([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block, different first block: no hit at all
    assert kv.match_prefix(make([0, 2, 3, 4, 5, 6, 7, 8, 9], "x")) == []
    other = KVCacheManager(16, BS, "other-model")
    other.pool = kv.pool  # same physical pool, other namespace
    assert other.match_prefix(make([1, 2, 3, 4, 5, 6, 7, 8, 9], "y")) == []


def test_referenced_blocks_are_never_evicted_and_lru_order_holds():
    pool = BlockPool(3)
    a = pool.allocate()
    pool.register(a, b"A")
    b = pool.allocate()
    pool.register(b, b"B")
    pool.release(a)  # A is free but cached
    c = pool.allocate()  # takes the never-used block first
    assert c not in (a, b) and pool.cached == {b"A": a, b"B": b}
    d = pool.allocate()  # now A must be evicted; B is still referenced
    assert d == a and b"A" not in pool.cached and b"B" in pool.cached
    assert pool.num_free == 0


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(2, BS, "ns")
    req = make(range(12))
    assert not kv.allocate(req, 12)
    assert req.block_ids == [] and kv.pool.num_free == 2
    assert kv.allocate(req, 8)
    assert len(req.block_ids) == 2


def test_free_releases_tail_first_so_prefix_survives_longer():
    kv = KVCacheManager(3, BS, "ns")
    a = make(range(12))
    run_prefill(kv, a)
    kv.free(a)
    # one new block needed: the tail block (third) is evicted, the prefix stays
    other = make([99] * 3, "o")
    assert kv.allocate(other, 3)
    assert len(kv.match_prefix(make(range(12), "again"))) == 2


def test_prefix_caching_disabled():
    kv = KVCacheManager(8, BS, None)
    run_prefill(kv, make(range(10)))
    assert kv.match_prefix(make(range(10), "b")) == []


def test_block_keys_keep_their_stored_format():
    """Keys name blocks that persistent stores keep for days, across versions and machines: block
    i's key is SHA-256 over the namespace, block i-1's key and its token ids as 4-byte
    little-endian integers. Computed here one token at a time, as the format is written down."""
    import hashlib

    tokens = [0, 1, 255, 256, 65_535, 65_536, 129_279, 2**32 - 1, 7, 8, 9]  # 2 full blocks of 4 + 3
    kv = KVCacheManager(16, BS, "model-a")
    req = make(tokens)
    kv.match_prefix(req)
    parent, expected = b"", []
    for i in range(len(tokens) // BS):
        h = hashlib.sha256(b"model-a" + parent)
        for t in tokens[i * BS : (i + 1) * BS]:
            h.update(t.to_bytes(4, "little"))
        parent = h.digest()
        expected.append(parent)
    assert req.block_keys == expected

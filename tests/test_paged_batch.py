"""``deepinfer_core.testing.paged_batch``: the scattered block tables that the attention-kernel
tests and benchmarks draw. Checked against the core's torch reference backend (its K/V write
and its attention read the cache only through ``slot_mapping`` and ``block_tables``) and against
the generator's own ``randperm``."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.attention import AttentionKind, AttentionLayerSpec
from deepinfer_core.attention.torch_ref import TorchAttentionBackend
from deepinfer_core.testing.paged_batch import scattered_batch


def test_tables_take_the_pool_permutation_in_request_order():
    """The blocks are ``randperm(used + spare)`` from the caller's generator, dealt out to the
    requests in order, and the generator is left where one such draw leaves it (callers' later
    draws do not move)."""
    g = torch.Generator().manual_seed(4)
    batch = scattered_batch([6, 9, 1, 32], 1, block_size=4, generator=g, spare_blocks=3)
    mirror = torch.Generator().manual_seed(4)
    perm = torch.randperm(2 + 3 + 1 + 8 + 3, generator=mirror).tolist()
    assert batch.num_blocks == 17 and batch.block_tables.dtype == torch.int32
    assert batch.block_tables.shape == (4, 8)
    rows = [batch.block_tables[r, :n].tolist() for r, n in enumerate([2, 3, 1, 8])]
    assert sum(rows, []) == perm[:14]
    assert batch.block_tables[0, 2:].eq(0).all() and batch.block_tables[2, 1:].eq(0).all()
    assert torch.equal(torch.rand(5, generator=g), torch.rand(5, generator=mirror))


def test_step_layout_is_the_last_tokens_of_each_request():
    batch = scattered_batch([5, 3, 40], [2, 7, 40], block_size=16, generator=torch.Generator().manual_seed(0))
    assert batch.query_lens == (2, 3, 40)  # a request shorter than its count runs whole
    assert batch.seq_lens == (5, 3, 40) and batch.num_tokens == 45
    assert batch.query_start_loc.tolist() == [0, 2, 5, 45]
    assert batch.positions.tolist() == [3, 4, 0, 1, 2] + list(range(40))
    assert batch.num_attention_pairs == (4 + 5) + (1 + 2 + 3) + sum(range(1, 41))
    meta = batch.metadata("cpu", num_context_tokens=48)
    assert (meta.max_query_len, meta.max_seq_len, meta.num_context_tokens, meta.num_tokens) == (40, 40, 48, 45)
    assert torch.equal(meta.slot_mapping, batch.slot_mapping)
    zeros = torch.zeros(45, dtype=torch.long)
    assert torch.equal(batch.metadata("cpu", slot_mapping=zeros).slot_mapping, zeros)


@pytest.mark.parametrize("seed", range(4))
def test_reference_backend_reads_back_what_it_wrote_through_the_slots(seed):
    """Prefill whole prompts through the torch reference (write at ``slot_mapping``, attend over
    ``block_tables``): with one-hot values per position every output row is a mix of its own
    request's values only (a slot in another request's block would leak its values), every slot
    is distinct, inside the pool, and the only row written for its token."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 50, (3,), generator=g).tolist()
    batch = scattered_batch(lens, lens, block_size=8, generator=g, spare_blocks=2)
    slots = batch.slot_mapping
    assert len(set(slots.tolist())) == batch.num_tokens and int(slots.max()) < batch.num_blocks * 8
    spec = AttentionLayerSpec(AttentionKind.FULL, 0, 1, 1, 4, 3, scale=0.5)
    ref = TorchAttentionBackend()
    cache = torch.zeros(ref.kv_cache_shape(spec, batch.num_blocks, 8), dtype=torch.float64)
    T = batch.num_tokens
    v = torch.eye(3, dtype=torch.float64)[batch.requests][:, None, :]  # request r's value: e_r
    k = torch.randn(T, 1, 4, generator=g, dtype=torch.float64)
    out = ref.forward(spec, torch.randn(T, 1, 4, generator=g, dtype=torch.float64), k, v, cache, batch.metadata("cpu"))
    torch.testing.assert_close(out[:, 0], v[:, 0])
    written = ref.cache_rows(cache).ne(0).any(dim=1).nonzero()[:, 0]
    assert torch.equal(written, slots.sort().values)  # T distinct rows, each at its token's slot


@pytest.mark.parametrize(
    ("lens", "new", "kwargs", "names"),
    [
        ([], 1, {}, "lens and new"),
        ([4, 5], [1], {}, "lens and new"),
        ([4, 0], 1, {}, "lens and new must be >= 1"),
        ([4], 0, {}, "lens and new must be >= 1"),
        ([4], 1, {"block_size": 0}, "block_size"),
        ([4], 1, {"spare_blocks": -1}, "spare_blocks"),
    ],
)
def test_bad_input_names_the_argument(lens, new, kwargs, names):
    args = {"block_size": 4, "generator": torch.Generator()} | kwargs
    with pytest.raises(ValueError, match=names):
        scattered_batch(lens, new, **args)

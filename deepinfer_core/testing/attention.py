"""Conformance suite for attention backends (``deepinfer_attention_backend``).

Subclass :class:`AttentionBackendSuite` and override the ``backend`` and ``platform`` fixtures
(``backend`` may ask for the ``spec`` fixture). The cases run are the kinds the backend claims:
its ``capabilities`` (:class:`~deepinfer_core.attention.AttentionCapabilities`), narrowed by
``supported_kinds`` when set; a kind it does not claim is skipped with the reason. A backend that
declares no capabilities (the previous contract) runs exactly ``supported_kinds``::

    class TestMyAttention(AttentionBackendSuite):
        supported_kinds = (AttentionKind.FULL, AttentionKind.MLA)

        @pytest.fixture
        def platform(self):
            return MyPlatform()

        @pytest.fixture
        def backend(self, spec, platform):
            return MyBackend()

Every test is parametrised over spec *cases* of the claimed kinds (MHA and GQA for ``full``,
the absorbed single-latent-head form for ``mla``, GQA with a short window for ``sliding``) and
checked against :func:`dense_reference`, a float64 loop written here on purpose: it shares no
code with the core's own torch backend, so a bug there cannot hide a bug here.

The schedule below runs three steps over one paged cache (block size 4, shuffled blocks, block
0 in real use so padding that reads it shows up)::

    step 1   r0 prefill 0..6     r1 prefill 0..2   r2 prefill 0..8
    step 2   r0 chunk   7..10    r1 decode  3      r2 decode  9      (chunked prefill + decode)
    step 3   r0 decode  11                         r2 decode  10     (r1 idle)

Cache layout: the suite reads entries through :meth:`AttentionBackendSuite.slot_entries`, which
assumes the cache is slot-major (``[num_blocks, block_size, ...]``); override it otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from ..attention import AttentionBackend, AttentionKind, AttentionLayerSpec, AttentionMetadata
from .attention_shared import BLOCK_SIZE, NUM_BLOCKS, SCHEDULE, SENTINEL, TOTAL_LEN, skip_unclaimed
from .platform import usable_device

__all__ = [
    "AttentionBackendSuite",
    "BLOCK_SIZE",
    "CASES",
    "NUM_BLOCKS",
    "SCHEDULE",
    "SENTINEL",
    "Scenario",
    "TOTAL_LEN",
    "dense_reference",
    "make_spec",
]

CASES: dict[AttentionKind, tuple[str, ...]] = {
    AttentionKind.FULL: ("full-mha", "full-gqa"),
    AttentionKind.MLA: ("mla-absorbed",),
    AttentionKind.SLIDING: ("sliding-gqa",),
}


def make_spec(case: str, kv_dtype: torch.dtype = torch.float32) -> AttentionLayerSpec:
    """The layer spec for a suite case (small, but with every head mapping that matters)."""
    common = dict(layer_index=0, kv_dtype=kv_dtype)
    if case == "full-mha":
        return AttentionLayerSpec(
            AttentionKind.FULL, num_heads=4, num_kv_heads=4, head_dim=16, v_head_dim=16, scale=0.25, **common
        )
    if case == "full-gqa":  # 3 query heads per KV head, V narrower than K
        return AttentionLayerSpec(
            AttentionKind.FULL, num_heads=6, num_kv_heads=2, head_dim=16, v_head_dim=8, scale=0.25, **common
        )
    if case == "mla-absorbed":  # one latent head: K = [latent 16 | rope 8], V = latent
        return AttentionLayerSpec(
            AttentionKind.MLA,
            num_heads=4,
            num_kv_heads=1,
            head_dim=24,
            v_head_dim=16,
            scale=0.2,
            rope_dim=8,
            kv_shared=True,
            **common,
        )
    if case == "sliding-gqa":
        return AttentionLayerSpec(
            AttentionKind.SLIDING,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            v_head_dim=16,
            scale=0.25,
            window=5,
            **common,
        )
    raise ValueError(case)


def dense_reference(spec: AttentionLayerSpec, q, k, v, positions) -> torch.Tensor:
    """Plain causal attention for one request, one query at a time, in float64.

    ``q`` [N, H, D] are the queries at ``positions``; ``k`` [L, Hkv, D] and ``v`` [L, Hkv, Dv]
    hold the request's whole context (``v`` is ``k[..., :Dv]`` when ``spec.kv_shared``).
    Query head h reads KV head ``h // (H // Hkv)``.
    """
    if spec.kv_shared:
        v = k[..., : spec.v_head_dim]
    group = spec.num_heads // spec.num_kv_heads
    out = torch.zeros(q.shape[0], spec.num_heads, spec.v_head_dim, dtype=torch.float64)
    for i, pos in enumerate(positions.tolist()):
        lo = 0 if spec.window is None else max(0, pos - spec.window + 1)
        for h in range(spec.num_heads):
            keys = k[lo : pos + 1, h // group].double()  # [n, D]
            values = v[lo : pos + 1, h // group].double()  # [n, Dv]
            scores = keys @ q[i, h].double() * spec.scale
            weights = torch.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ values
    return out


@dataclass
class Scenario:
    """Per-request Q/K/V for every position, block tables, and the batches of each step."""

    spec: AttentionLayerSpec
    device: torch.device
    dtype: torch.dtype
    seed: int = 0

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        s = self.spec
        self.q = [torch.randn(n, s.num_heads, s.head_dim, generator=g) for n in TOTAL_LEN]
        self.k = [torch.randn(n, s.num_kv_heads, s.head_dim, generator=g) for n in TOTAL_LEN]
        self.v = [None if s.kv_shared else torch.randn(n, s.num_kv_heads, s.v_head_dim, generator=g) for n in TOTAL_LEN]
        blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.tables: list[list[int]] = []
        for n in TOTAL_LEN:
            need = math.ceil(n / BLOCK_SIZE)
            self.tables.append(blocks[:need])
            blocks = blocks[need:]

    def batch(self, step: int, only: int | None = None, batch_invariant: bool = False):
        """``(q, k, v, meta, items)`` for one step, optionally restricted to request ``only``."""
        items = [it for it in SCHEDULE[step] if only is None or it[0] == only]
        qs, ks, vs, pos, slots, starts, seq_lens = [], [], [], [], [], [0], []
        for r, first, count in items:
            span = slice(first, first + count)
            qs.append(self.q[r][span])
            ks.append(self.k[r][span])
            if self.v[r] is not None:
                vs.append(self.v[r][span])
            p = torch.arange(first, first + count)
            pos.append(p)
            table = torch.tensor(self.tables[r])
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            starts.append(starts[-1] + count)
            seq_lens.append(first + count)
        width = max(len(self.tables[r]) for r, _, _ in items)
        tables = torch.zeros(len(items), width, dtype=torch.int32)
        for i, (r, _, _) in enumerate(items):
            tables[i, : len(self.tables[r])] = torch.tensor(self.tables[r])
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            positions=torch.cat(pos).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            block_tables=tables.to(dev),
            block_size=BLOCK_SIZE,
            max_query_len=max(c for _, _, c in items),
            max_seq_len=max(seq_lens),
            batch_invariant=batch_invariant,
        )
        q = torch.cat(qs).to(dev, self.dtype)
        k = torch.cat(ks).to(dev, self.dtype)
        v = torch.cat(vs).to(dev, self.dtype) if vs else None
        return q, k, v, meta, items

    def expected(self, step: int) -> torch.Tensor:
        rows = []
        for r, first, count in SCHEDULE[step]:
            positions = torch.arange(first, first + count)
            ctx = first + count
            v = None if self.v[r] is None else self.v[r][:ctx]
            rows.append(dense_reference(self.spec, self.q[r][first:ctx], self.k[r][:ctx], v, positions))
        return torch.cat(rows)


class AttentionBackendSuite:
    """What every :class:`~deepinfer_core.attention.AttentionBackend` must do."""

    # The kinds to test; empty: every kind the backend declares (AttentionCapabilities.kinds).
    supported_kinds: tuple[AttentionKind, ...] = ()
    dtype: torch.dtype = torch.float32  # query/key/value dtype fed to the backend
    kv_dtype: torch.dtype = torch.float32
    atol: float = 2e-5
    rtol: float = 1e-4

    def pytest_generate_tests(self, metafunc) -> None:
        if "case" in metafunc.fixturenames:
            kinds = self.supported_kinds or tuple(CASES)
            unknown = [k for k in kinds if k not in CASES]
            cases = [c for k in kinds if k in CASES for c in CASES[k]]
            cases += [
                pytest.param(k.value, marks=pytest.mark.skip(reason=f"no dense reference for {k.value}"))
                for k in unknown
            ]
            metafunc.parametrize("case", cases)

    @pytest.fixture
    def platform(self):
        pytest.fail("an AttentionBackendSuite subclass must override the `platform` fixture")

    @pytest.fixture
    def backend(self, spec, platform) -> AttentionBackend:
        pytest.fail("an AttentionBackendSuite subclass must override the `backend` fixture")

    @pytest.fixture
    def spec(self, case) -> AttentionLayerSpec:
        return make_spec(case, self.kv_dtype)

    @pytest.fixture(autouse=True)
    def _claimed(self, request) -> None:
        if "case" in request.fixturenames:
            skip_unclaimed(request.getfixturevalue("backend"), request.getfixturevalue("spec"), self.supported_kinds)

    @pytest.fixture
    def device(self, platform) -> torch.device:
        return usable_device(platform)

    @pytest.fixture
    def scenario(self, spec, device) -> Scenario:
        return Scenario(spec, device, self.dtype)

    def slot_entries(self, kv_cache: torch.Tensor, backend=None) -> torch.Tensor:
        """The cache as ``[num_slots, -1]`` (one row per token slot): the backend's own
        ``cache_rows(kv_cache)`` when it has one, else a slot-major layout is assumed
        (``[num_blocks, block_size, ...]``); override for anything else."""
        if backend is not None and hasattr(backend, "cache_rows"):
            return backend.cache_rows(kv_cache)
        return kv_cache.reshape(NUM_BLOCKS * BLOCK_SIZE, -1)

    def new_cache(self, backend, spec, device) -> torch.Tensor:
        shape = backend.kv_cache_shape(spec, NUM_BLOCKS, BLOCK_SIZE)
        return torch.full(shape, SENTINEL, dtype=spec.kv_dtype, device=device)

    def run_steps(self, backend, spec, scenario, cache, steps, **kw) -> list[torch.Tensor]:
        outs = []
        for step in steps:
            q, k, v, meta, _ = scenario.batch(step, **kw)
            outs.append(backend.forward(spec, q, k, v, cache, meta))
        return outs

    # -- tests ----------------------------------------------------------------------------
    def test_is_an_attention_backend(self, backend):
        assert isinstance(backend, AttentionBackend)
        assert isinstance(backend.name, str) and backend.name

    def test_kv_cache_shape_is_int_tuple_proportional_to_blocks(self, backend, spec):
        shape = backend.kv_cache_shape(spec, NUM_BLOCKS, BLOCK_SIZE)
        assert isinstance(shape, tuple) and all(type(d) is int and d > 0 for d in shape)
        double = backend.kv_cache_shape(spec, 2 * NUM_BLOCKS, BLOCK_SIZE)
        assert math.prod(double) == 2 * math.prod(shape)

    def test_output_shape_dtype_device(self, backend, spec, scenario, device):
        cache = self.new_cache(backend, spec, device)
        q, k, v, meta, _ = scenario.batch(0)
        out = backend.forward(spec, q, k, v, cache, meta)
        assert out.shape == (meta.num_tokens, spec.num_heads, spec.v_head_dim)
        assert out.dtype == q.dtype
        assert out.device.type == device.type

    def test_new_kv_written_at_slot_mapping(self, backend, spec, scenario, device):
        cache = self.new_cache(backend, spec, device)
        q, k, v, meta, _ = scenario.batch(0)
        backend.forward(spec, q, k, v, cache, meta)
        rows = self.slot_entries(cache, backend).float().cpu()
        slots = meta.slot_mapping.tolist()
        for t, slot in enumerate(slots):
            assert torch.isin(k[t].float().cpu().flatten(), rows[slot]).all(), f"K of token {t} not at slot {slot}"
            if v is not None:
                assert torch.isin(v[t].float().cpu().flatten(), rows[slot]).all(), f"V of token {t} not at slot {slot}"
        untouched = torch.ones(rows.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert (rows[untouched] == SENTINEL).all(), "slots outside slot_mapping were modified"

    @pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "invariant"])
    def test_matches_dense_reference_over_prefill_chunk_and_decode(
        self, backend, spec, scenario, device, batch_invariant
    ):
        cache = self.new_cache(backend, spec, device)
        outs = self.run_steps(backend, spec, scenario, cache, range(len(SCHEDULE)), batch_invariant=batch_invariant)
        for step, out in enumerate(outs):
            torch.testing.assert_close(
                out.double().cpu(),
                scenario.expected(step),
                atol=self.atol,
                rtol=self.rtol,
                msg=lambda m, step=step: f"step {step + 1} of the schedule: {m}",
            )

    def test_batch_invariant_request_alone_equals_in_batch(self, backend, spec, scenario, device):
        for step in range(len(SCHEDULE)):
            shared = self.new_cache(backend, spec, device)
            self.run_steps(backend, spec, scenario, shared, range(step))  # context of earlier steps
            batched = self.run_steps(backend, spec, scenario, shared.clone(), [step], batch_invariant=True)[0]
            _, _, _, _, items = scenario.batch(step)
            start = 0
            for r, _, count in items:
                alone = self.run_steps(backend, spec, scenario, shared.clone(), [step], only=r, batch_invariant=True)[0]
                assert torch.equal(alone, batched[start : start + count]), (
                    f"step {step + 1}, request {r}: not bitwise equal"
                )
                start += count


def __getattr__(name: str):
    """The DeepSeek-V4 kinds (``state_kv`` specs: one case each for sliding, compressed sparse and
    heavily compressed) have their own suite, :class:`V4AttentionBackendSuite`, kept in
    ``v4_attention`` for size and reachable from here."""
    if name in ("V4AttentionBackendSuite", "V4_CASES", "make_v4_spec", "v4_dense_reference"):
        from . import v4_attention

        return getattr(v4_attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

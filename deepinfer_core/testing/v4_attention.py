"""Conformance suite for DeepSeek-V4 attention backends (``AttentionLayerSpec.state_kv``).

One case per V4 kind, so a plugin can claim exactly one: ``v4-sliding`` (window only),
``v4-csa`` (window + the indexer's chosen compressed entries), ``v4-hca`` (window + every
visible entry). Subclass :class:`V4AttentionBackendSuite` and override ``platform`` and
``backend``; the kinds run are those the backend claims (``AttentionCapabilities.state_kv_kinds``),
narrowed by ``supported_kinds`` when set, the rest skipped with the reason (a backend declaring
no capabilities runs exactly ``supported_kinds``)::

    class TestMyV4(V4AttentionBackendSuite):
        supported_kinds = (AttentionKind.COMPRESSED_SPARSE,)
        ...

The suite plays the model's part: it writes the compressed entries of every window finished by
the end of a step into ``cache.entries`` (as the model's compressors do) and, for CSA, picks
entries per query (some slots ``-1``), then runs the three-step schedule of the paged suite
(prefill, chunk + decode, decode) over a shuffled block table and shuffled state slots. The
expected output is :func:`v4_dense_reference`, a float64 loop written here on purpose.
"""

from __future__ import annotations

import pytest
import torch

from ..attention import AttentionKind, AttentionLayerSpec, AttentionMetadata
from .attention_shared import BLOCK_SIZE, NUM_BLOCKS, SCHEDULE, SENTINEL, TOTAL_LEN, skip_unclaimed
from .platform import usable_device

__all__ = [
    "SLOTS",
    "V4AttentionBackendSuite",
    "V4Cache",
    "V4Scenario",
    "V4_CASES",
    "make_v4_spec",
    "v4_dense_reference",
]


V4_CASES = {
    AttentionKind.SLIDING: "v4-sliding",
    AttentionKind.COMPRESSED_SPARSE: "v4-csa",
    AttentionKind.HEAVILY_COMPRESSED: "v4-hca",
}
_RATIO = {"v4-sliding": 0, "v4-csa": 2, "v4-hca": 4}
SLOTS = (2, 0, 3)  # state slot of each request (slot 1 stays unused)


def make_v4_spec(case: str, kv_dtype: torch.dtype = torch.float32) -> AttentionLayerSpec:
    kind = next(k for k, c in V4_CASES.items() if c == case)
    return AttentionLayerSpec(
        kind, layer_index=0, num_heads=4, num_kv_heads=1, head_dim=16, v_head_dim=16, scale=0.25, rope_dim=4,
        kv_shared=True, window=5, compress_ratio=_RATIO[case], index_topk=2 if case == "v4-csa" else 0,
        kv_dtype=kv_dtype, state_kv=True,
    )  # fmt: skip


class V4Cache:
    """What a V4 backend reads and writes (same fields as ``deepseek_v4_kv.V4LayerCache``)."""

    def __init__(self, spec: AttentionLayerSpec, device) -> None:
        per_block = BLOCK_SIZE // spec.compress_ratio if spec.compress_ratio else 0
        full = dict(dtype=spec.kv_dtype, device=device)
        self.entries = torch.full((NUM_BLOCKS, per_block, spec.head_dim), SENTINEL, **full)
        self.window = torch.full((4, spec.window - 1, spec.head_dim), SENTINEL, **full)
        self.tail = torch.zeros((4, 0, 0), **full)


def v4_dense_reference(spec, q, kv, entries, sinks, positions, selected) -> torch.Tensor:
    """One request: queries ``q`` [N, H, D] at ``positions``, keys ``kv`` [L, D] of its whole
    context, ``entries`` [E, D] compressed entries, ``selected`` [N, k] (CSA) -> [N, H, D]."""
    out = torch.zeros(q.shape[0], spec.num_heads, spec.head_dim, dtype=torch.float64)
    for i, p in enumerate(positions.tolist()):
        keys = [kv[j].double() for j in range(max(0, p - spec.window + 1), p + 1)]
        if spec.kind is AttentionKind.HEAVILY_COMPRESSED:
            keys += [entries[w].double() for w in range((p + 1) // spec.compress_ratio)]
        elif spec.kind is AttentionKind.COMPRESSED_SPARSE:
            keys += [entries[w].double() for w in selected[i].tolist() if w >= 0]
        k = torch.stack(keys)  # [n, D]
        for h in range(spec.num_heads):
            s = k @ q[i, h].double() * spec.scale
            m = torch.maximum(s.max(), sinks[h].double())
            w = torch.exp(s - m)
            out[i, h] = (w / (w.sum() + torch.exp(sinks[h].double() - m))) @ k
    return out


class V4Scenario:
    def __init__(self, spec: AttentionLayerSpec, device, dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.spec, self.device, self.dtype = spec, device, dtype
        self.q = [torch.randn(n, spec.num_heads, spec.head_dim, generator=g) for n in TOTAL_LEN]
        self.kv = [torch.randn(n, spec.head_dim, generator=g) for n in TOTAL_LEN]
        ratio = spec.compress_ratio or 1
        self.entries = [torch.randn(n // ratio, spec.head_dim, generator=g) for n in TOTAL_LEN]
        self.sinks = torch.randn(spec.num_heads, generator=g)
        self.selected = []  # per request and position: up to 2 visible entries, or -1
        for n in TOTAL_LEN:
            rows = []
            for p in range(n):
                visible = (p + 1) // ratio
                pick = torch.randperm(visible, generator=g)[:2].tolist() if visible else []
                rows.append(pick + [-1] * (2 - len(pick)))
            self.selected.append(torch.tensor(rows, dtype=torch.long))
        blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.tables = []
        for n in TOTAL_LEN:
            need = -(-n // BLOCK_SIZE)
            self.tables.append(blocks[:need])
            blocks = blocks[need:]

    def write_entries(self, cache: V4Cache, r: int, upto: int) -> None:
        """Entries of windows finished by position ``upto`` (exclusive), as the model writes them."""
        if not self.spec.compress_ratio:
            return
        per_block = BLOCK_SIZE // self.spec.compress_ratio
        for w in range(upto // self.spec.compress_ratio):
            block = self.tables[r][w // per_block]
            cache.entries[block, w % per_block] = self.entries[r][w].to(cache.entries.dtype)

    def batch(self, step: int, cache: V4Cache, only: int | None = None, batch_invariant: bool = False):
        items = [it for it in SCHEDULE[step] if only is None or it[0] == only]
        qs, kvs, pos, sel, starts, seq_lens = [], [], [], [], [0], []
        for r, first, count in items:
            self.write_entries(cache, r, first + count)
            qs.append(self.q[r][first : first + count])
            kvs.append(self.kv[r][first : first + count])
            sel.append(self.selected[r][first : first + count])
            pos.append(torch.arange(first, first + count))
            starts.append(starts[-1] + count)
            seq_lens.append(first + count)
        width = max(len(self.tables[r]) for r, _, _ in items)
        tables = torch.zeros(len(items), width, dtype=torch.int32)
        for i, (r, _, _) in enumerate(items):
            tables[i, : len(self.tables[r])] = torch.tensor(self.tables[r])
        dev = self.device
        positions = torch.cat(pos)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            positions=positions.to(dev),
            slot_mapping=torch.zeros_like(positions).to(dev),  # unused: V4 keys go to state rings
            block_tables=tables.to(dev),
            block_size=BLOCK_SIZE,
            max_query_len=max(c for _, _, c in items),
            max_seq_len=max(seq_lens),
            batch_invariant=batch_invariant,
            state_slots=torch.tensor([SLOTS[r] for r, _, _ in items], dtype=torch.long, device=dev),
        )
        selected = torch.cat(sel).to(dev) if self.spec.kind is AttentionKind.COMPRESSED_SPARSE else None
        return torch.cat(qs).to(dev, self.dtype), torch.cat(kvs).to(dev, self.dtype), meta, selected, items

    def expected(self, step: int) -> torch.Tensor:
        rows = []
        for r, first, count in SCHEDULE[step]:
            rows.append(v4_dense_reference(
                self.spec, self.q[r][first : first + count], self.kv[r], self.entries[r], self.sinks,
                torch.arange(first, first + count), self.selected[r][first : first + count],
            ))  # fmt: skip
        return torch.cat(rows)


class V4AttentionBackendSuite:
    """What every DeepSeek-V4 attention backend (``forward_v4``) must do."""

    # The kinds to test; empty: every kind the backend declares (state_kv_kinds).
    supported_kinds: tuple[AttentionKind, ...] = ()
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype = torch.float32
    atol: float = 2e-5
    rtol: float = 1e-4

    def pytest_generate_tests(self, metafunc) -> None:
        if "case" in metafunc.fixturenames:
            metafunc.parametrize("case", [V4_CASES[k] for k in self.supported_kinds or tuple(V4_CASES)])

    @pytest.fixture
    def platform(self):
        pytest.fail("a V4AttentionBackendSuite subclass must override the `platform` fixture")

    @pytest.fixture
    def backend(self, spec, platform):
        pytest.fail("a V4AttentionBackendSuite subclass must override the `backend` fixture")

    @pytest.fixture
    def spec(self, case) -> AttentionLayerSpec:
        return make_v4_spec(case, self.kv_dtype)

    @pytest.fixture(autouse=True)
    def _claimed(self, request) -> None:
        if "case" in request.fixturenames:
            skip_unclaimed(request.getfixturevalue("backend"), request.getfixturevalue("spec"), self.supported_kinds)

    @pytest.fixture
    def device(self, platform) -> torch.device:
        return usable_device(platform)

    @pytest.fixture
    def scenario(self, spec, device) -> V4Scenario:
        return V4Scenario(spec, device, self.dtype)

    def run(self, backend, scenario, cache, steps, **kw):
        outs = []
        for step in steps:
            q, kv, meta, selected, _ = scenario.batch(step, cache, **kw)
            sinks = scenario.sinks.to(q.device)
            outs.append(backend.forward_v4(scenario.spec, q, kv, sinks, cache, meta, selected))
        return outs

    def test_is_a_v4_backend(self, backend):
        assert isinstance(backend.name, str) and backend.name
        assert callable(getattr(backend, "forward_v4", None))

    @pytest.mark.parametrize("batch_invariant", [False, True], ids=["batched", "invariant"])
    def test_matches_dense_reference_over_prefill_chunk_and_decode(
        self, backend, scenario, spec, device, batch_invariant
    ):
        cache = V4Cache(spec, device)
        outs = self.run(backend, scenario, cache, range(len(SCHEDULE)), batch_invariant=batch_invariant)
        for step, out in enumerate(outs):
            assert out.shape == (scenario.batch(step, V4Cache(spec, device))[0].shape[0], spec.num_heads, spec.head_dim)
            torch.testing.assert_close(
                out.double().cpu(),
                scenario.expected(step),
                atol=self.atol,
                rtol=self.rtol,
                msg=lambda m, step=step: f"{spec.kind.value}, step {step + 1} of the schedule: {m}",
            )

    def test_block_entries_are_read_not_written(self, backend, scenario, spec, device):
        cache = V4Cache(spec, device)
        for step in range(len(SCHEDULE)):
            q, kv, meta, selected, _ = scenario.batch(step, cache)
            before = cache.entries.clone()
            backend.forward_v4(spec, q, kv, scenario.sinks.to(device), cache, meta, selected)
            assert torch.equal(cache.entries, before), f"step {step + 1}: block entries were modified"
        assert (cache.window[1] == SENTINEL).all(), "a state slot no request holds was modified"

    def test_batch_invariant_request_alone_equals_in_batch(self, backend, scenario, spec, device):
        for step in range(len(SCHEDULE)):
            shared = V4Cache(spec, device)
            self.run(backend, scenario, shared, range(step))
            snapshot = (shared.entries.clone(), shared.window.clone())
            batched = self.run(backend, scenario, shared, [step], batch_invariant=True)[0]
            start = 0
            for r, _, count in SCHEDULE[step]:
                alone_cache = V4Cache(spec, device)
                alone_cache.entries.copy_(snapshot[0])
                alone_cache.window.copy_(snapshot[1])
                alone = self.run(backend, scenario, alone_cache, [step], only=r, batch_invariant=True)[0]
                assert torch.equal(alone, batched[start : start + count]), (
                    f"step {step + 1}, request {r}: not bitwise equal"
                )
                start += count

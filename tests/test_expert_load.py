"""Per-expert load counted on the device (deepinfer_core.parallel.load, engine option
``expert_load_window``): through the engine, the counts of DeepSeek-V3 and V4 (hash-routed and
learned layers, tiny configs, random weights) equal a brute-force count of every router decision,
window by window; counting adds no host synchronisation; off by default."""

from __future__ import annotations

import collections

import pytest
import torch

from deepinfer_core.parallel.load import ExpertLoadCounter
from deepinfer_core.testing.host_sync import NoHostSync, host_reads_allowed

pytest.importorskip("transformers")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.testing.v3_checkpoint import SMALL_V3_CONFIG, tiny_deepseek_v3  # noqa: E402
from deepinfer_core.testing.v4_tiny import save_tiny_v4  # noqa: E402

WINDOW = 2


class Spy:
    """A layer's dispatcher that also writes down every router decision, with the step it was in."""

    def __init__(self, inner, layer_index: int, counter: ExpertLoadCounter, log: list) -> None:
        self.inner, self.layer_index, self.counter, self.log = inner, layer_index, counter, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def select_experts(self, spec, *args, **kwargs):
        ids, weights = self.inner.select_experts(spec, *args, **kwargs)
        self.log.append((self.counter.steps, self.layer_index, ids.tolist()))
        return ids, weights


def moe_layers(model):
    layers = [*model.model.layers, *(getattr(model, "mtp", None) or ())]
    return [layer.mlp for layer in layers if getattr(layer.mlp, "dispatcher", None) is not None]


def brute_force(log, layers, num_experts, steps):
    """``{window: [L, E] counts}`` of the logged decisions (step s belongs to window (s-1) // WINDOW)."""
    per_window = collections.defaultdict(lambda: torch.zeros(len(layers), num_experts, dtype=torch.long))
    for step, layer, rows in log:
        assert 1 <= step <= steps
        for row in rows:
            for expert in row:
                per_window[(step - 1) // WINDOW][layers.index(layer), expert] += 1
    return per_window


def check_counts_match_the_router(path, prompts, new_tokens):
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=8, max_num_seqs=4, expert_load_window=WINDOW)
    engine = llm.engine
    counter = engine.expert_load
    mlps = moe_layers(engine.model)
    assert counter is not None and counter.layers == tuple(m.spec.layer_index for m in mlps)
    log: list = []
    for mlp in mlps:
        assert mlp.expert_load is counter
        mlp.dispatcher = Spy(mlp.dispatcher, mlp.spec.layer_index, counter, log)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, [params] * len(prompts))
    steps = counter.steps
    assert steps >= 2 * WINDOW + 1 and counter.windows_done == (steps - 1) // WINDOW
    want = brute_force(log, list(counter.layers), counter.num_experts, steps)
    done = counter.windows_done
    assert torch.equal(counter.counts, want[done])  # the open window
    assert torch.equal(counter.last_window(), want[done - 1])
    assert torch.equal(counter.load(), sum(want[w] for w in range(done)))
    routed = sum(len(rows) for _, layer, rows in log if layer == counter.layers[-1])
    assert int(sum(want.values())[-1].sum()) == routed * mlps[-1].spec.top_k
    return engine


def test_v3_counts_equal_the_router_decisions(tmp_path):
    tiny_deepseek_v3(tmp_path, seed=3, router_gain=4.0, **SMALL_V3_CONFIG)
    prompts = [[5, 9, 13, 200, 17, 40, 41], [7, 8, 100, 300], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    engine = check_counts_match_the_router(str(tmp_path), prompts, 6)
    assert len(engine.expert_load.layers) == 2  # layer 0 is dense


def test_v4_counts_equal_the_router_decisions_hash_layers_included(tmp_path):
    save_tiny_v4(tmp_path, 5, 6)
    prompts = [[5, 9, 13, 200, 17, 40, 41, 50, 60], [7, 8, 100, 300]]
    engine = check_counts_match_the_router(str(tmp_path), prompts, 6)
    hashed = [m.spec.layer_index for m in moe_layers(engine.model) if m.spec.scoring == "hash"]
    assert hashed and set(hashed) < set(engine.expert_load.layers)


class ExpertsUnguarded:
    """The reference dispatcher's expert loop (it reads counts on the host) outside the guard;
    routing and counting stay guarded."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("forward", "forward_with_shared"):
            return attr

        def call(*args, **kwargs):
            with host_reads_allowed():
                return attr(*args, **kwargs)

        return call


def test_counting_adds_no_host_sync(tmp_path):
    save_tiny_v4(tmp_path, 5, 6)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8, expert_load_window=WINDOW)
    counter = llm.engine.expert_load
    g = torch.Generator().manual_seed(0)
    for mlp in moe_layers(llm.engine.model):
        mlp.dispatcher = ExpertsUnguarded(mlp.dispatcher)
        x = torch.randn(5, mlp.spec.hidden_size, generator=g)
        ids = torch.randint(2, 300, (5,), generator=g)
        row = counter.layers.index(mlp.spec.layer_index)
        with torch.inference_mode(), NoHostSync("MoE routing with load counting"):
            counter.step()  # may close a window (a device copy and a zero fill)
            before = counter.counts[row].clone()
            mlp(x, ids)
        assert int((counter.counts[row] - before).sum()) == 5 * mlp.spec.top_k
    # the guard does catch a sync: a counter that read its counts back would fail
    with pytest.raises(AssertionError, match="host synchronisation"), NoHostSync():
        counter.counts.sum().item()


def test_off_by_default(tmp_path):
    tiny_deepseek_v3(tmp_path, seed=3, **SMALL_V3_CONFIG)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=8)
    assert llm.engine.expert_load is None and llm.engine.runner.expert_load is None
    assert all(m.expert_load is None for m in moe_layers(llm.engine.model))


def test_counter_windows_ring_and_errors():
    counter = ExpertLoadCounter("cpu", window=2, history=2)
    counter.add_layer(7, 4)
    for step in range(7):  # steps 1..7: windows [1,2] [3,4] [5,6] closed, 7 open
        counter.step()
        counter.record(7, torch.tensor([[step % 4, (step + 1) % 4]]))
    assert counter.windows_done == 3
    # the ring keeps the last two windows: steps 3-4 (ids {2,3},{3,0}) and 5-6 ({0,1},{1,2})
    assert counter.load().tolist() == [[2, 2, 2, 2]]
    assert counter.last_window().tolist() == [[1, 2, 1, 0]]
    assert counter.counts.tolist() == [[0, 0, 1, 1]]
    with pytest.raises(ValueError, match="has 5 experts, the others 4"):
        counter.add_layer(8, 5)
    with pytest.raises(ValueError, match="added twice"):
        counter.add_layer(7, 4)
    with pytest.raises(ValueError, match="window and history must be >= 1"):
        ExpertLoadCounter("cpu", window=0)
    with pytest.raises(ValueError, match="expert_load_window must be >= 0"):
        LLM("unused", expert_load_window=-1)

"""The decode-graph hook (``deepinfer_decode_graphs``) as the engine uses it, with a recording
CPU stand-in for a CUDA-graph policy: pure decode steps are offered to it, prefill is not, a
scratch KV block is reserved for padded rows, a declined step runs eagerly, and the tokens are
the eager engine's. (The CUDA implementation is checked on a GPU by the cuda_sm100 plugin.)"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_host import PluginHost

pytest.importorskip("transformers")  # the tiny_llama fixture (tests/conftest.py) builds with it


class Recorder:
    """Runs offered steps eagerly (so results must match) and declines every third one."""

    def __init__(self, model, kv_caches, *, block_size, scratch_block, max_num_seqs, max_blocks) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.args = dict(
            block_size=block_size, scratch_block=scratch_block, max_num_seqs=max_num_seqs, max_blocks=max_blocks
        )
        self.offered: list[int] = []

    def run(self, input_ids, meta):
        self.offered.append(meta.num_requests)
        assert meta.max_query_len == 1 and input_ids.shape[0] == meta.num_requests
        if len(self.offered) % 3 == 0:
            return None
        return self.model.forward(input_ids, meta.positions, self.kv_caches, meta)


class GraphPlugin:
    @hookimpl
    def deepinfer_decode_graphs(self, platform):
        return Recorder


def test_decode_steps_are_offered_and_tokens_match_eager(tiny_llama):
    from deepinfer_core import LLM, SamplingParams

    host = PluginHost(load_entry_points=False, extra_plugins={"graphs": GraphPlugin()})
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    llm = LLM(tiny_llama, device="cpu", kv_cache_blocks=4, max_num_seqs=8, host=host)
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs, Recorder)
    assert graphs.args == dict(block_size=128, scratch_block=4, max_num_seqs=8, max_blocks=2)
    assert all(cache.shape[2] == 5 for cache in llm.engine.runner.kv_caches)  # 4 blocks + scratch
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert graphs.offered == [2] * 5  # the prefill step is never offered; 5 decode steps are
    eager = LLM(tiny_llama, device="cpu", kv_cache_blocks=4, max_num_seqs=8, enforce_eager=True, host=host)
    assert eager.engine.runner.graphs is None and eager.engine.runner.kv_caches[0].shape[2] == 4
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


def test_no_graphs_without_a_provider_or_in_batch_invariant_mode(tiny_llama):
    from deepinfer_core import LLM

    assert (
        PluginHost(load_entry_points=False).decode_graphs(PluginHost(load_entry_points=False).platform("cpu")) is None
    )
    host = PluginHost(load_entry_points=False, extra_plugins={"graphs": GraphPlugin()})
    assert (
        LLM(tiny_llama, device="cpu", kv_cache_blocks=4, batch_invariant=True, host=host).engine.runner.graphs is None
    )


def test_batch_invariant_engines_enter_the_platforms_invariant_ops(tiny_llama):
    from contextlib import contextmanager

    from deepinfer_core import LLM, SamplingParams

    entered: list[int] = []

    @contextmanager
    def ops():
        entered.append(1)
        yield

    class InvariantPlugin:
        @hookimpl
        def deepinfer_batch_invariant_ops(self, platform):
            return ops

    host = PluginHost(load_entry_points=False, extra_plugins={"inv": InvariantPlugin()})
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    LLM(tiny_llama, device="cpu", kv_cache_blocks=4, host=host).generate([[5, 6]], params)
    assert entered == []
    LLM(tiny_llama, device="cpu", kv_cache_blocks=4, batch_invariant=True, host=host).generate([[5, 6]], params)
    assert len(entered) == 3  # one prefill step and two decode steps


class HeadRecorder(Recorder):
    """Also offers ``run_logits`` (the LM head and argmax inside the replay) and runs it
    eagerly; a subclass's ``shift`` moves its ids, so a test sees which rows' tokens the engine
    took from them."""

    shift = 0

    def run_logits(self, input_ids, meta):
        self.offered.append(-meta.num_requests)
        hidden = self.model.forward(input_ids, meta.positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return logits, (torch.argmax(logits, dim=-1) + self.shift) % logits.shape[-1]


class ShiftedHeadRecorder(HeadRecorder):
    shift = 1


def head_plugin(recorder):
    class HeadPlugin:
        @hookimpl
        def deepinfer_decode_graphs(self, platform):
            return recorder

    return HeadPlugin()


def test_captured_head_ids_are_the_tokens_of_plain_greedy_rows_only(tiny_llama):
    from deepinfer_core import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=5, ignore_eos=True)
    penalised = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]

    def tokens(llm, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    eager = LLM(tiny_llama, device="cpu", kv_cache_blocks=4, max_num_seqs=8, enforce_eager=True)
    want = {name: tokens(eager, p) for name, p in (("greedy", greedy), ("sampled", sampled), ("penalised", penalised))}
    host = PluginHost(load_entry_points=False, extra_plugins={"graphs": head_plugin(HeadRecorder)})
    llm = LLM(tiny_llama, device="cpu", kv_cache_blocks=4, max_num_seqs=8, host=host)
    assert tokens(llm, greedy) == want["greedy"]
    assert llm.engine.runner.graphs.offered == [-2] * 4  # every decode step took the head with it
    host = PluginHost(load_entry_points=False, extra_plugins={"graphs": head_plugin(ShiftedHeadRecorder)})
    llm = LLM(tiny_llama, device="cpu", kv_cache_blocks=4, max_num_seqs=8, host=host)
    shifted = tokens(llm, greedy)  # wrong ids: greedy decode steps take them, prefill samples eagerly
    assert [t[0] for t in shifted] == [t[0] for t in want["greedy"]]
    assert all(a != b for s, w in zip(shifted, want["greedy"]) for a, b in zip(s[1:2], w[1:2]))
    assert tokens(llm, sampled) == want["sampled"]  # sampled rows: the sampler, on the step's logits
    assert tokens(llm, penalised) == want["penalised"]  # penalties change the logits: not the ids


def test_speculative_verify_steps_are_offered_as_decode_rows(tiny_llama):
    """With drafts, a Llama verify step arrives as decode rows (a row per token), so the buckets go
    up to max_num_seqs x (gamma + 1) rows; the tokens are the spec-off engine's."""
    from deepinfer_core import LLM, SamplingParams

    host = PluginHost(load_entry_points=False, extra_plugins={"graphs": GraphPlugin()})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 10, 8, 9, 10, 8, 9]]  # repeats: the n-gram drafter has matches
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(tiny_llama, device="cpu", kv_cache_blocks=8, max_num_seqs=4, host=host, speculative_config=spec)
    graphs = llm.engine.runner.graphs
    assert graphs.args["max_num_seqs"] == 4 * (3 + 1)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert max(graphs.offered) > len(prompts)  # a verify step: more rows than requests
    plain = LLM(tiny_llama, device="cpu", kv_cache_blocks=8, max_num_seqs=4, enforce_eager=True, host=host)
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]


class HiddenHeadRecorder(HeadRecorder):
    """Also offers ``run_logits_hidden`` (the head, the argmax and the pre-norm rows of one
    replay), run eagerly."""

    def run_logits_hidden(self, input_ids, meta):
        self.offered.append(("all", meta.num_requests))
        hidden, pre = self.model.forward_hidden(input_ids, meta.positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return logits, torch.argmax(logits, dim=-1), pre


def test_an_engine_keeping_hidden_rows_takes_the_head_from_the_replay_too(tiny_llama):
    """A speculative engine whose drafter reads the target's hidden rows (keep_hidden) takes
    logits, greedy ids and pre-norm rows from one offered replay, as a plain engine takes the
    head (it used to run the LM head eagerly after run_hidden); tokens are the eager engine's."""
    from deepinfer_core import LLM, SamplingParams

    host = PluginHost(load_entry_points=False, extra_plugins={"graphs": head_plugin(HiddenHeadRecorder)})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 10, 11, 12]]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(tiny_llama, device="cpu", kv_cache_blocks=8, max_num_seqs=4, host=host, speculative_config=spec)
    llm.engine.runner.keep_hidden = True  # as for a drafter that reads the hidden rows
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    offered = llm.engine.runner.graphs.offered
    assert any(isinstance(o, tuple) and o[0] == "all" for o in offered)
    assert not any(isinstance(o, int) and o < 0 for o in offered)  # never run_logits without the rows
    plain = LLM(tiny_llama, device="cpu", kv_cache_blocks=8, max_num_seqs=4, enforce_eager=True)
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]

"""DeepSeek-V4 decode in CUDA graphs (``v4_graphs.py`` over the model's ``forward_decode``).

On any machine: the static-buffer step (``capture=False``: the same buffers and padding, run
eagerly) is checked step by step against the general eager forward on a copy of the cache -
same hidden states, same cache afterwards (ring, compressor tails, compressed entries) - while
a dispatch mode fails on any op that reads a device value back to the host (``.item()``,
``.tolist()``, ``nonzero``, boolean masks): the step a graph captures has no host sync. The
prompts cross compression windows (ratio 4 and 16) and the indexer ranks more than
``index_topk`` entries, with 3 requests padded to a bucket of 4; layers 3 and 4 (CSA, HCA) run
their compressors through the plugin's kernel (``compress_decode``), layers 1 and 2 through the
core's torch form.
On a GPU: captured graphs give the eager engine's greedy tokens (float32).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.testing.host_sync import NoHostSync, host_reads_allowed  # noqa: E402
from deepinfer_core.testing.v4_tiny import save_tiny_v4, tiny_v4_config  # noqa: E402

PROMPTS_LENS = (5, 23, 61)  # CSA ranks > index_topk (6) entries from 28 tokens on
NEW = 16


class KernelCompressors:
    """A V4 backend whose decode-step compressors run the plugin's kernel (Triton's interpreter
    on the CPU: its host reads are the interpreter's, outside the guard)."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.calls = 0

    def forward_v4(self, *args, **kwargs):
        return self.inner.forward_v4(*args, **kwargs)

    def compress_decode(self, *args):
        from deepinfer_cuda_sm100.attention import TritonV4Attention

        self.calls += 1
        with host_reads_allowed():
            return TritonV4Attention().compress_decode(*args)


class Unguarded:
    """The builtin MoE's expert computation (the graph path runs the plugin's fused kernels)
    outside the guard; its routing (the plugin's too) stays guarded."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != "forward":
            return attr

        def call(*args, **kwargs):
            with host_reads_allowed():
                return attr(*args, **kwargs)

        return call


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4-graphs")
    model = save_tiny_v4(path, 4321, 3, tiny_v4_config(max_position_embeddings=512))
    g = torch.Generator().manual_seed(11)
    return str(path), [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in PROMPTS_LENS]


def _generate(llm, prompts):
    # different lengths: the batch shrinks to 2 requests, then to 1
    params = [SamplingParams(temperature=0, max_tokens=NEW + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _cpu_engine(path):
    """A float32 CPU engine of the tiny V4, its MoE's expert computation outside the host-sync
    guard (:class:`Unguarded`): (llm, engine, model, caches)."""
    torch.set_num_threads(1)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=8, max_num_seqs=4)
    engine = llm.engine
    model, caches = engine.model, engine.runner.kv_caches
    for m in model.modules():
        if getattr(m, "dispatcher", None) is not None:
            m.dispatcher = Unguarded(m.dispatcher)
    return llm, engine, model, caches


def test_static_decode_step_equals_the_general_step_without_host_syncs(checkpoint):
    from deepinfer_cuda_sm100.v4_graphs import V4DecodeGraphs

    path, prompts = checkpoint
    llm, engine, model, caches = _cpu_engine(path)
    # the kernel on this CPU model needs Triton's interpreter (conftest sets it where there is no
    # GPU; on a GPU machine the kernel runs compiled in test_v4_compressor_kernel and the graph test)
    interpreted = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()
    kernels = [KernelCompressors(layer.self_attn.backend) for layer in model.model.layers[3:]] if interpreted else []
    for layer, backend in zip(model.model.layers[3:], kernels):  # a CSA and an HCA layer: the plugin's kernel
        layer.self_attn.backend = backend
    static = V4DecodeGraphs(model, caches, block_size=128, scratch_block=7, max_num_seqs=4, max_blocks=4, capture=False)
    assert static.buckets == [1, 2, 4]
    checked = []

    class Checked:
        def run(self, input_ids, meta):
            copy = [type(c)(c.entries.clone(), c.window.clone(), c.tail.clone()) for c in caches]
            want = model.forward(input_ids, meta.positions, copy, meta)
            with NoHostSync("the V4 decode step"):
                got = static.run(input_ids, meta)
            assert got is not None
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for layer, (a, b) in enumerate(zip(caches, copy)):
                for name in ("entries", "window", "tail"):
                    torch.testing.assert_close(
                        getattr(a, name),
                        getattr(b, name),
                        rtol=1e-4,
                        atol=1e-4,
                        msg=lambda m: f"layer {layer} {name}: {m}",
                    )
            checked.append(int(meta.num_requests))
            return got

    engine.runner.graphs = Checked()
    tokens = _generate(llm, prompts)
    assert all(k.calls for k in kernels)
    assert {3, 2, 1} <= set(checked)  # 3 padded to the bucket of 4, 2 and 1 in their own
    assert len(checked) >= NEW + 4 * (len(prompts) - 1) - 1
    plain = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=8, max_num_seqs=4)
    assert tokens == _generate(plain, prompts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_v4_graph_replay_matches_eager(checkpoint):
    pytest.importorskip("triton")
    path, prompts = checkpoint
    prompts = prompts + [list(range(2, 300)), [7] * 140]  # 5 requests: the bucket of 8; long enough to rank
    graphed = LLM(path, device="cuda", dtype="float32", kv_cache_blocks=16, max_num_seqs=8)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.v4 is not None and graphs.v4.graphs, "V4 decode was not captured"
    assert set(graphs.v4.heads) == set(
        graphs.v4.buckets
    )  # max_num_seqs 8 <= HEAD_ROWS: every bucket replays the LM head + argmax
    eager = LLM(path, device="cuda", dtype="float32", kv_cache_blocks=16, max_num_seqs=8, enforce_eager=True)
    assert _generate(graphed, prompts) == _generate(eager, prompts)


def test_static_decode_step_keeps_the_streams_the_mtp_drafter_reads(checkpoint):
    # run_hidden: the same static step, returning the last layer's streams too (an MTP engine's
    # plain and drafted steps replay graphs instead of running the general forward eagerly)
    from deepinfer_cuda_sm100.v4_graphs import V4DecodeGraphs

    path, prompts = checkpoint
    llm, engine, model, caches = _cpu_engine(path)
    static = V4DecodeGraphs(model, caches, block_size=128, scratch_block=7, max_num_seqs=4, max_blocks=4, capture=False)
    checked = []

    class Checked:
        def run_hidden(self, input_ids, meta):
            copy = [type(c)(c.entries.clone(), c.window.clone(), c.tail.clone()) for c in caches]
            want_hidden, want_streams = model.forward_hidden(input_ids, meta.positions, copy, meta)
            with NoHostSync("the V4 decode step"):
                got = static.run_hidden(input_ids, meta)
            assert got is not None
            hidden, streams = got
            assert streams.shape == want_streams.shape == (meta.num_requests, model.cfg.hc_mult, model.cfg.hidden_size)
            torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(streams, want_streams, rtol=1e-4, atol=1e-4)
            checked.append(int(meta.num_requests))
            return got

    engine.runner.graphs, engine.runner.keep_hidden = Checked(), True
    tokens = _generate(llm, prompts)
    assert {3, 2, 1} <= set(checked)
    plain = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=8, max_num_seqs=4)
    assert tokens == _generate(plain, prompts)

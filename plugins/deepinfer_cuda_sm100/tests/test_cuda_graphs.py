"""CUDA-graph decode (``deepinfer_decode_graphs``): the hook answers for CUDA platforms only;
on a GPU, replayed graphs (with padded buckets) give the eager engine's tokens."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.platform import TorchPlatform
from deepinfer_cuda_sm100 import CudaSM100Platform, plugin


def test_hook_answers_for_cuda_platforms_only():
    from deepinfer_cuda_sm100.graphs import CudaDecodeGraphs

    assert plugin.deepinfer_decode_graphs(TorchPlatform("cpu", "cpu")) is None
    assert plugin.deepinfer_decode_graphs(CudaSM100Platform()) is CudaDecodeGraphs
    assert plugin.deepinfer_batch_invariant_ops(TorchPlatform("cpu", "cpu")) is None


def _tiny_llama(path, hidden: int = 32):
    """A 2-layer Llama of the given width, seed 0, saved to ``path`` (the tests' checkpoint)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def test_padded_static_step_equals_the_eager_step_and_pads_into_the_scratch_block(tmp_path):
    """What a replay reads, on any machine: each decode step's rows copied into the static
    inputs and padded to its bucket (token 0 at position 0 in the scratch block), the model run
    eagerly over them (the torch reference attention: nothing is captured). The real rows give
    the eager step's hidden states and KV; the padded rows write into the scratch block only; the
    tokens are the eager engine's."""
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.plugin_host import PluginHost
    from deepinfer_cuda_sm100.decode_capture import smallest_bucket
    from deepinfer_cuda_sm100.graphs import CudaDecodeGraphs

    _tiny_llama(tmp_path)
    checked: list[tuple[int, int]] = []

    class Static:
        def __init__(self, model, kv_caches, **kw) -> None:
            self.graphs = CudaDecodeGraphs(model, kv_caches, **kw)
            assert not self.graphs.graphs and self.graphs.buckets == [1, 2, 4, 8]
            self.model, self.kv_caches, self.scratch = model, kv_caches, kw["scratch_block"]

        @torch.inference_mode()
        def run(self, input_ids, meta):
            n = meta.num_requests
            bucket = smallest_bucket(self.graphs.buckets, n)
            eager_caches = [c.clone() for c in self.kv_caches]
            want = self.model.forward(input_ids, meta.positions, eager_caches, meta)
            self.graphs._fill(bucket, input_ids, meta)
            got = self.graphs._step(bucket)[:n]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for ours, eager in zip(self.kv_caches, eager_caches):  # [planes, heads, blocks, block, width]
                others = [b for b in range(ours.shape[2]) if b != self.scratch]
                torch.testing.assert_close(ours[:, :, others], eager[:, :, others], rtol=1e-5, atol=1e-5)
                assert torch.equal(ours[:, :, self.scratch, 1:], eager[:, :, self.scratch, 1:])  # position 0 only
                assert bucket == n or ours[:, :, self.scratch, 0].abs().sum() > 0  # (the cache starts zeroed)
            checked.append((n, bucket))
            return got

    class StaticPlugin:
        @hookimpl
        def deepinfer_decode_graphs(self, platform):
            return Static

    host = PluginHost(load_entry_points=False, extra_plugins={"static": StaticPlugin()})
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12] * 30, [13]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 9, 12)]
    llm = LLM(
        str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=16, block_size=16, max_num_seqs=8, host=host
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert {(3, 4), (2, 2), (1, 1)} <= set(checked)  # 3 rows padded to the bucket of 4, then 2 and 1
    eager = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        kv_cache_blocks=16,
        block_size=16,
        max_num_seqs=8,
        enforce_eager=True,
    )
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


def test_an_idle_step_reads_and_writes_only_the_scratch_block(tmp_path):
    """What ``replay_idle`` replays, run eagerly over the static inputs on any machine: every row
    a padding row attending over IDLE_CONTEXT positions of the scratch block. Every other block of
    a cache holding a live request's KV is untouched, and the request decodes after it as without;
    with nothing captured (this CPU) the call declines."""
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_cuda_sm100.graphs import IDLE_CONTEXT, CudaDecodeGraphs

    _tiny_llama(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_blocks=24, block_size=16, max_num_seqs=8)
    want = llm.generate([[5, 6, 7] * 20], params)[0].outputs[0].token_ids
    engine = llm.engine
    caches = engine.runner.kv_caches
    scratch = engine.num_blocks  # the engine holds no graphs here: a block past its own, as with graphs
    caches = [torch.cat([c, torch.zeros_like(c[:, :, :1])], dim=2) for c in caches]
    graphs = CudaDecodeGraphs(engine.model, caches, block_size=16, scratch_block=scratch, max_num_seqs=8,
                              max_blocks=IDLE_CONTEXT // 16 + 2)  # fmt: skip
    assert not graphs.graphs and graphs.replay_idle(3) is False  # nothing captured on a CPU
    before = [c.clone() for c in caches]
    graphs._fill_idle(4)
    with torch.inference_mode():
        hidden = graphs._step(4)
    assert torch.isfinite(hidden).all()
    assert graphs.inputs.seq_lens[:4].tolist() == [IDLE_CONTEXT] * 4
    for ours, old in zip(caches, before):  # [planes, heads, blocks, block, width]
        assert torch.equal(ours[:, :, :scratch], old[:, :, :scratch])
        assert not torch.equal(ours[:, :, scratch], old[:, :, scratch])  # the step wrote its one position there
    assert llm.generate([[5, 6, 7] * 20], params)[0].outputs[0].token_ids == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_dspark_times_its_curve_from_graph_replays_and_stays_exact(tmp_path):
    """A speculative engine with DSpark measures its steps/s curve by replaying its captured
    buckets idle (at most the largest bucket's rows; eager forwards past it), the live requests
    decode the tokens of an engine without speculation, and a replayed point costs less than the
    eager forward of as many tokens (a GPU launches a bare forward's kernels one by one)."""
    pytest.importorskip("triton")
    import time

    import numpy as np

    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.engine import spec_decode
    from deepinfer_cuda_sm100.graphs import CudaDecodeGraphs

    _tiny_llama(tmp_path, hidden=64)
    calls: list[tuple[int, bool]] = []
    real = CudaDecodeGraphs.replay_idle

    def spy(self, rows):
        got = real(self, rows)
        calls.append((rows, got))
        return got

    spec_decode._CURVES.clear()
    CudaDecodeGraphs.replay_idle = spy
    try:
        cfg = {"method": "ngram", "num_speculative_tokens": 3, "verification": "confidence"}
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=8,
                  speculative_config=cfg)  # fmt: skip
    finally:
        CudaDecodeGraphs.replay_idle = real
    largest = llm.engine.runner.graphs.buckets[-1]
    assert largest == 32  # 8 requests x (3 drafts + 1)
    assert calls and all(got == (rows <= largest) for rows, got in calls)
    assert {rows for rows, got in calls if got} == {1, 2, 4, 8, 16, 32}
    rate = llm.engine.spec.rate
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=64, max_num_seqs=8, enforce_eager=True)
    t0 = time.perf_counter()
    for _ in range(3):
        eager.engine._time_forward(8)
    eager_s = (time.perf_counter() - t0) / 3
    assert 1.0 / rate(np.array([8]))[0] < eager_s
    prompts = [[5, 6, 7] * 10, [8, 9, 10, 11, 12] * 30, [13]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in eager.generate(prompts, params)
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replay_matches_eager(tmp_path):
    pytest.importorskip("triton")
    from deepinfer_core import LLM, SamplingParams

    _tiny_llama(tmp_path, hidden=64)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12] * 30, [13]]  # 3 requests: replayed in the bucket of 4
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    graphed = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=8, max_num_seqs=8)
    assert graphed.engine.runner.graphs is not None
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=8, max_num_seqs=8, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in eager.generate(prompts, params)
    ]


def test_models_with_host_synchronising_kernels_are_not_captured():
    from deepinfer_core.attention.torch_ref import TorchAttentionBackend
    from deepinfer_core.moe.torch_ref import TorchMoEDispatcher
    from deepinfer_cuda_sm100.attention import TritonAttention
    from deepinfer_cuda_sm100.graphs import uncapturable
    from deepinfer_cuda_sm100.moe import TritonMoEDispatcher

    class Layer(torch.nn.Module):
        def __init__(self, backend, dispatcher):
            super().__init__()
            self.backend, self.dispatcher = backend, dispatcher

    ours = torch.nn.ModuleList([Layer(TritonAttention(), TritonMoEDispatcher())])
    assert uncapturable(ours) == []
    mixed = torch.nn.ModuleList(
        [Layer(TritonAttention(), TorchMoEDispatcher()), Layer(TorchAttentionBackend(), TritonMoEDispatcher())]
    )
    assert uncapturable(mixed) == ["torch-reference"]


def test_a_model_with_per_request_state_kv_stays_eager():
    """DeepSeek-V4's caches are not plain tensors: the factory must not fail, and every step
    must be declined (found on the H200: the engine failed to start a V4 model)."""
    from deepinfer_core.attention import AttentionMetadata
    from deepinfer_cuda_sm100.graphs import CudaDecodeGraphs

    graphs = CudaDecodeGraphs(None, [object()], block_size=128, scratch_block=4, max_num_seqs=8, max_blocks=4)
    one = torch.zeros(1, dtype=torch.long)
    meta = AttentionMetadata(
        torch.tensor([0, 1], dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        one,
        one,
        torch.zeros(1, 1, dtype=torch.int32),
        128,
        1,
        1,
    )
    assert graphs.run(one, meta) is None

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graph_replay_matches_eager(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("triton")
    from deepinfer_core import LLM, SamplingParams

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12] * 30, [13]]  # 3 requests: replayed in the bucket of 4
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    graphed = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=8, max_num_seqs=8)
    assert graphed.engine.runner.graphs is not None
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=8, max_num_seqs=8, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


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
    mixed = torch.nn.ModuleList([Layer(TritonAttention(), TorchMoEDispatcher()), Layer(TorchAttentionBackend(), TritonMoEDispatcher())])
    assert uncapturable(mixed) == ["torch-reference"]


def test_a_model_with_per_request_state_kv_stays_eager():
    """DeepSeek-V4's caches are not plain tensors: the factory must not fail, and every step
    must be declined (found on the H200: the engine failed to start a V4 model)."""
    from deepinfer_core.attention import AttentionMetadata
    from deepinfer_cuda_sm100.graphs import CudaDecodeGraphs

    graphs = CudaDecodeGraphs(None, [object()], block_size=128, scratch_block=4, max_num_seqs=8, max_blocks=4)
    one = torch.zeros(1, dtype=torch.long)
    meta = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32), one, one, torch.zeros(1, 1, dtype=torch.int32), 128, 1, 1)
    assert graphs.run(one, meta) is None

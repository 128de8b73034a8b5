"""``FusedOps.logits`` (float32 logits from the 16-bit LM head) against a float64 product, and
the LM head + greedy argmax captured in the decode graphs (``run_logits``) on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install deepinfer-cuda-sm100[triton])")

from deepinfer_core.fused_ops import logits_reference  # noqa: E402
from deepinfer_cuda_sm100.kernels.invariant import BatchInvariantOps  # noqa: E402
from deepinfer_cuda_sm100.kernels.logits import lm_logits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(rows: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, 512, generator=g) * 2).to(DEVICE, dtype)
    weight = (torch.randn(3000, 512, generator=g) * 0.5).to(DEVICE, dtype)
    return hidden, weight


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_logits_are_the_float32_product_not_rounded_to_bf16(rows):
    hidden, weight = _operands(rows, rows)
    exact = hidden.double() @ weight.double().t()
    got = lm_logits(hidden, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, 3000)
    err = (got.double() - exact).abs().max().item()
    rounded = (torch.nn.functional.linear(hidden, weight).float().double() - exact).abs().max().item()  # the bf16 head
    assert err < 1e-3 and err < rounded / 20, (err, rounded)
    assert torch.allclose(got, logits_reference(hidden, weight), rtol=0, atol=1e-3)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the fixed-order kernel's compiled code needs a GPU (the interpreter runs this head for minutes; "
    "test_invariant_ops checks its arithmetic on the CPU)",
)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_batch_invariant_logits_do_not_depend_on_the_batch(rows):
    hidden, weight = _operands(rows, 40 + rows)
    with BatchInvariantOps():
        together = lm_logits(hidden, weight)
        alone = torch.cat([lm_logits(hidden[i : i + 1], weight) for i in range(rows)])
    assert together.dtype == torch.float32 and torch.equal(together, alone)
    exact = hidden.double() @ weight.double().t()
    assert (together.double() - exact).abs().max().item() < 1e-3


def test_the_plugin_offers_float32_logits_and_models_take_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    from deepinfer_core import LLM
    from deepinfer_core.fused_ops import install
    from deepinfer_cuda_sm100 import CudaSM100Platform, plugin

    ops = plugin.deepinfer_fused_ops(CudaSM100Platform())
    assert ops.logits is lm_logits
    cfg = transformers.LlamaConfig(vocab_size=3000, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                                   tie_word_embeddings=False)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = LLM(str(tmp_path), device=DEVICE, dtype="bfloat16", kv_cache_blocks=2, fused_ops=False).engine.model
    hidden, weight = _operands(3, 9)
    model.lm_head.weight.data.copy_(weight)
    before = model.compute_logits(hidden)  # the bf16 head, cast
    assert model.logits_kernel is None and install(model, ops) >= 1 and model.logits_kernel is lm_logits
    exact = hidden.double() @ weight.double().t()
    assert (model.compute_logits(hidden).double() - exact).abs().max() < (before.double() - exact).abs().max() / 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_small_buckets_replay_the_head_and_argmax_and_keep_the_eager_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_cuda_sm100.graphs import HEAD_ROWS

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12] * 30, [13]]
    graphed = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=8, max_num_seqs=128)
    graphs = graphed.engine.runner.graphs
    assert sorted(graphs.heads) == [b for b in graphs.buckets if b <= HEAD_ROWS] and 128 in graphs.graphs
    calls = []
    run_logits = graphs.run_logits
    graphs.run_logits = lambda ids, meta: calls.append(meta.num_requests) or run_logits(ids, meta)
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_blocks=8, max_num_seqs=8, enforce_eager=True)
    for params in (
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, max_tokens=20, ignore_eos=True),
    ):
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
        assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert calls and set(calls) == {3}  # decode steps of 3 requests: bucket 4, head replayed

"""A speculative drafter's proposal in CUDA graphs (``draft_graphs``): replays equal the eager
function for every row count up to the largest bucket; an engine with the learned drafter on a
GPU captures its chain and still gives spec-off's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from deepinfer_cuda_sm100.draft_graphs import capture_draft

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_inputs_off_a_cuda_device_are_not_captured():
    assert capture_draft(lambda x: (x,), (torch.zeros(4, 2),)) is None
    assert capture_draft(lambda x: (x,), ()) is None


@cuda
def test_replays_equal_the_eager_function_for_every_row_count():
    torch.manual_seed(0)
    w = torch.randn(16, 24, device="cuda")

    def fn(x, ids):
        h = torch.tanh(x @ w.T) + ids[:, None].float()
        return h.argmax(-1), torch.sigmoid(h).sum(-1)

    example = (torch.zeros(12, 24, device="cuda"), torch.zeros(12, dtype=torch.long, device="cuda"))
    graphs = capture_draft(fn, example)
    assert graphs is not None and graphs.buckets[-1] == 12
    for n in (1, 2, 3, 5, 8, 11, 12):
        x, ids = torch.randn(n, 24, device="cuda"), torch.randint(0, 5, (n,), device="cuda")
        got, want = graphs(x, ids), fn(x, ids)
        assert got[0].tolist() == want[0].tolist() and torch.allclose(got[1], want[1], atol=1e-6)
    too_many = (torch.zeros(13, 24, device="cuda"), torch.zeros(13, dtype=torch.long, device="cuda"))
    assert graphs(*too_many) is None


@cuda
def test_an_engine_with_the_learned_drafter_captures_its_chain_and_keeps_greedy_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.models.llama.drafter import DraftHead, DraftHeadConfig, save_head

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    head = DraftHead(DraftHeadConfig.for_target(cfg.to_dict(), 32, "tiny", 4))
    head.vocab_ids.copy_(torch.arange(32))
    save_head(head, str(tmp_path / "head"))
    model = str(tmp_path / "model")
    prompts = [{"prompt_token_ids": list(range(2 + i, 20 + i))} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in LLM(model, **common).generate(prompts, params)]
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}
    llm = LLM(model, speculative_config=spec, **common)
    assert llm.engine.spec.drafter._graphed is not None  # the chain replays from graphs
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.spec.stats()["num_draft_tokens"] > 0

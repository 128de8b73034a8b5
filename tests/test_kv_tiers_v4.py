"""DeepSeek-V4 through the persistent KV store (issue 9, deliverable 3): block KV (compressed
entries, indexer keys) goes to the store; state KV (window rings, compressor tails) is rebuilt
after a store hit by the exact replay the device prefix cache uses. Engine A serves a prompt with
a store; a new engine B hits it; both give transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.fail("transformers >= 5.24 (DeepseekV4) is required for the DeepSeek-V4 tests")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.testing.v4_tiny import TINY_V4_KWARGS, save_tiny_v4  # noqa: E402

NEW = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4-store")
    return str(path), save_tiny_v4(path, seed=4321, randomise_seed=6)


def reference(hf, prompt: list[int], new: int = NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def greedy(new: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)


def test_v4_block_kv_served_from_the_store_by_a_new_engine(checkpoint, tmp_path):
    path, hf = checkpoint
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompt = torch.randint(
            2, TINY_V4_KWARGS["vocab_size"], (600,), generator=torch.Generator().manual_seed(31)
        ).tolist()
        ref = reference(hf, prompt)
        url = f"local://{tmp_path / 'store'}"
        a = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, kv_store=url)
        first = a.generate([prompt], greedy())[0]
        a.engine.tiers.flush()
        assert a.engine.stats()["kv_tiers"]["blocks_written"] == 4  # (600 + 9) // 128 full blocks
        b = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, kv_store=url)
        second = b.generate([prompt], greedy())[0]
        assert first.num_cached_tokens == 0 and second.num_cached_tokens == 512
        assert b.engine.stats()["kv_tiers"]["store_blocks_loaded"] == 4
        assert first.outputs[0].token_ids == ref and second.outputs[0].token_ids == ref
        # a prefix hit from the store with a new suffix: state rebuilt at 384, then 150 new tokens
        branch = (
            prompt[:384]
            + torch.randint(
                2, TINY_V4_KWARGS["vocab_size"], (150,), generator=torch.Generator().manual_seed(32)
            ).tolist()
        )
        c = LLM(path, device="cpu", dtype="float32", kv_cache_blocks=16, kv_store=url)
        out = c.generate([branch], greedy(12))[0]
        assert out.num_cached_tokens == 384 and out.outputs[0].token_ids == reference(hf, branch, 12)
    finally:
        torch.set_num_threads(before)
